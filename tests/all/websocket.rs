//! WebSocket messages as a tier's unit, end to end: an axum server behind the layer on
//! 127.0.0.1, its handlers metering their sockets with the `MessageBudget` the layer gives
//! them, and a real WebSocket client (tokio-tungstenite) over the upgrade.
#![cfg(feature = "ws")]

use crate::support;
use crate::support::stores::frozen_memory;

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::Response;
use axum::routing::get;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message as ClientMessage;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tollgate::clock::FakeClock;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::{MemoryStore, Store};
use tollgate::ws::{BudgetSpent, MessageBudget};
use tollgate::{Concurrency, Policy, Quota, RateLimitLayer, StreamMode, Unit};

/// What a handler did once its socket ended.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) received: u64,
    sent: u64,
    spent: Option<BudgetSpent>,
}

pub(crate) type Reports = mpsc::UnboundedSender<Done>;

/// Reads every message until the socket ends, counting the Text ones.
async fn upload(
    up: WebSocketUpgrade,
    budget: MessageBudget,
    State(done): State<Reports>,
) -> Response {
    up.on_upgrade(move |socket| async move {
        let mut socket = budget.wrap(socket);
        let mut received = 0;
        while let Some(message) = socket.recv().await {
            if matches!(message, Ok(Message::Text(_))) {
                received += 1;
            }
        }
        let spent = socket.spent().cloned();
        // The request ends with its socket: reported once it has.
        drop((socket, budget));
        let _ = done.send(Done { received, sent: 0, spent });
    })
}

/// Sends `n` Text messages (stopping at the first refused), then reads until the socket ends.
async fn download(
    up: WebSocketUpgrade,
    budget: MessageBudget,
    Path(n): Path<u64>,
    State(done): State<Reports>,
) -> Response {
    up.on_upgrade(move |socket| async move {
        let mut socket = budget.wrap(socket);
        let mut sent = 0;
        for i in 0..n {
            if socket.send(Message::Text(i.to_string().into())).await.is_err() {
                break;
            }
            sent += 1;
        }
        while socket.recv().await.is_some() {}
        let spent = socket.spent().cloned();
        drop((socket, budget));
        let _ = done.send(Done { received: 0, sent, spent });
    })
}

/// The routes: `/upload`, `/download/{n}` and a plain `/unary`.
pub(crate) fn routes() -> Router<Reports> {
    Router::new()
        .route("/upload", get(upload))
        .route("/download/{n}", get(download))
        .route("/unary", get(|| async { "ok" }))
}

/// The app made of `routes`, and the handlers' reports.
pub(crate) fn served(routes: Router<Reports>) -> (Router, mpsc::UnboundedReceiver<Done>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (routes.with_state(tx), rx)
}

/// The routes behind `layer`, and the handlers' reports.
fn app<St: Store>(layer: RateLimitLayer<GlobalKey, St>) -> (Router, mpsc::UnboundedReceiver<Done>) {
    served(routes().route_layer(layer))
}

/// 100 messages per second, burst 100, of `unit`, on one key for every request.
fn layer<St: Store>(unit: Unit, mode: StreamMode, store: St) -> RateLimitLayer<GlobalKey, St> {
    layer_of(messages_per_second("messages", 100, unit), mode, store)
}

fn messages_per_second(name: &str, count: u64, unit: Unit) -> Policy {
    Policy::builder(name).tier("messages", Quota::per_second(count).counting(unit)).build().unwrap()
}

/// `policy` on one key for every request, metering sockets in `mode`.
fn layer_of<St: Store>(
    policy: Policy,
    mode: StreamMode,
    store: St,
) -> RateLimitLayer<GlobalKey, St> {
    RateLimitLayer::builder(policy).key(GlobalKey).store(store).on_stream(mode).build().unwrap()
}

/// `policy` on one key for every request, with no stream setting, on a store whose clock
/// stands still.
fn layer_of_frozen(policy: Policy) -> RateLimitLayer<GlobalKey, MemoryStore> {
    RateLimitLayer::builder(policy).key(GlobalKey).store(frozen_memory()).build().unwrap()
}

/// Serves the routes behind [`layer_of_frozen`]: the server, the handlers' reports.
async fn serve_frozen(policy: Policy) -> (support::Server, mpsc::UnboundedReceiver<Done>) {
    let (app, reports) = app(layer_of_frozen(policy));
    (support::serve(app).await, reports)
}

/// Serves the app policing `unit` on a store whose clock stands still (nothing refills
/// unless the test moves it): the clock, the server, the handlers' reports.
async fn policed(unit: Unit) -> (FakeClock, support::Server, mpsc::UnboundedReceiver<Done>) {
    let clock = FakeClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let (app, reports) = app(layer(unit, StreamMode::Police, store));
    (clock, support::serve(app).await, reports)
}

pub(crate) type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub(crate) async fn connect(server: &support::Server, path: &str) -> Client {
    let url = format!("ws://{}{path}", server.addr);
    tokio_tungstenite::connect_async(url).await.expect("upgrade").0
}

/// What a client saw: the Text messages that came, and the server's Close frame.
pub(crate) struct Seen {
    texts: u64,
    pub(crate) close: Option<CloseFrame>,
}

/// Sends `n` Text messages while reading, then closes normally (when the server has not
/// closed first) and reads until the connection ends.
pub(crate) async fn talk(client: Client, n: u64) -> Seen {
    let (mut tx, mut rx) = client.split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            // Refused once the server's Close came in.
            if tx.send(ClientMessage::text(i.to_string())).await.is_err() {
                return;
            }
        }
        let _ = tx.send(ClientMessage::Close(None)).await;
    });
    let mut seen = Seen { texts: 0, close: None };
    let read = async {
        while let Some(message) = rx.next().await {
            match message {
                Ok(ClientMessage::Text(_)) => seen.texts += 1,
                Ok(ClientMessage::Close(frame)) => seen.close = frame,
                Ok(_) => {}
                Err(_) => break,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.expect("the connection ends");
    sender.await.unwrap();
    seen
}

pub(crate) async fn report(reports: &mut mpsc::UnboundedReceiver<Done>) -> Done {
    tokio::time::timeout(Duration::from_secs(10), reports.recv())
        .await
        .expect("the handler ends")
        .expect("a report")
}

/// Serves `app` and opens a socket on `path`: the body of the 500 the upgrade is refused with.
async fn upgrade_refused_with_500(app: Router, path: &str) -> String {
    let server = support::serve(app).await;
    let (status, body) = upgrade_refused(&format!("ws://{}{path}", server.addr)).await;
    assert_eq!(status, 500);
    body
}

/// Opens a socket at `url`, whose upgrade is refused: the status and body it is refused with.
async fn upgrade_refused(url: &str) -> (u16, String) {
    match tokio_tungstenite::connect_async(url).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(res)) => {
            let body = String::from_utf8(res.body().clone().unwrap_or_default()).unwrap();
            (res.status().as_u16(), body)
        }
        other => panic!("expected a refused upgrade, got {other:?}"),
    }
}

fn status_of(res: &support::Reply) -> u16 {
    res.status.as_u16()
}

#[tokio::test]
async fn policing_delivers_exactly_the_budget_then_closes_with_1008_and_the_wait() {
    // Time stands still: nothing refills while the test runs.
    let (clock, server, mut reports) = policed(Unit::RequestMessages).await;
    let seen = talk(connect(&server, "/upload").await, 300).await;
    let done = report(&mut reports).await;
    assert_eq!(done.received, 100);
    let close = seen.close.expect("a Close frame");
    assert_eq!(close.code, CloseCode::Policy);
    // The refused grant: near the limit what the socket needs, one message at 100/s (10 ms,
    // in whole seconds rounded up).
    assert_eq!(close.reason.as_str(), "rate limited; retry-after=1");
    let spent = done.spent.expect("stopped by policing");
    assert_eq!(spent.unit(), Unit::RequestMessages);
    assert_eq!(spent.retry_after(), Some(Duration::from_millis(10)));
    // A unary request of the same key is refused while the budget is spent.
    let client = support::client();
    let res = support::get(&client, &server.url("/unary"), &[]).await;
    assert_eq!(status_of(&res), 429);
    assert_eq!(res.header("retry-after"), Some("1"));
    // Ten messages' worth later, a socket gets exactly ten (the upgrade's is one of them).
    clock.advance(Duration::from_millis(100));
    let seen = talk(connect(&server, "/upload").await, 300).await;
    assert_eq!(report(&mut reports).await.received, 10);
    assert_eq!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
}

#[tokio::test]
async fn unary_requests_and_a_socket_share_one_budget() {
    let (_clock, server, mut reports) = policed(Unit::RequestMessages).await;
    let client = support::client();
    // Thirty unary requests take one message each from the budget of 100.
    for _ in 0..30 {
        assert_eq!(status_of(&support::get(&client, &server.url("/unary"), &[]).await), 200);
    }
    talk(connect(&server, "/upload").await, 300).await;
    assert_eq!(report(&mut reports).await.received, 70);
}

#[tokio::test]
async fn policing_counts_the_messages_sent_likewise() {
    let (_clock, server, mut reports) = policed(Unit::ResponseMessages).await;
    let seen = talk(connect(&server, "/download/300").await, 0).await;
    assert_eq!(seen.texts, 100);
    let close = seen.close.expect("a Close frame");
    assert_eq!(close.code, CloseCode::Policy);
    assert_eq!(close.reason.as_str(), "rate limited; retry-after=1");
    let done = report(&mut reports).await;
    assert_eq!(done.sent, 100);
    assert_eq!(done.spent.map(|s| s.unit()), Some(Unit::ResponseMessages));
    // A unary request of the same key is refused (it answers one message).
    let client = support::client();
    assert_eq!(status_of(&support::get(&client, &server.url("/unary"), &[]).await), 429);
}

#[tokio::test]
async fn a_socket_within_the_budget_is_not_stopped() {
    let (_clock, server, mut reports) = policed(Unit::RequestMessages).await;
    // Exactly the budget: the client closes normally, and is answered normally.
    let seen = talk(connect(&server, "/upload").await, 100).await;
    let done = report(&mut reports).await;
    assert_eq!((done.received, done.spent), (100, None));
    assert_ne!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
    // Nothing is left.
    let client = support::client();
    assert_eq!(status_of(&support::get(&client, &server.url("/unary"), &[]).await), 429);
}

#[tokio::test]
async fn control_frames_are_not_counted() {
    let (_clock, server, mut reports) = policed(Unit::RequestMessages).await;
    let mut client = connect(&server, "/upload").await;
    // 150 pings (each answered with a pong, not counted), then 100 messages: all delivered.
    for _ in 0..150 {
        client.send(ClientMessage::Ping(Default::default())).await.unwrap();
    }
    let seen = talk(client, 100).await;
    assert_eq!(report(&mut reports).await.received, 100);
    assert_ne!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
}

#[tokio::test]
async fn settling_lets_a_socket_run_and_charges_its_messages_when_it_ends() {
    let clock = FakeClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let (app, mut reports) = app(layer(Unit::RequestMessages, StreamMode::Settle, store));
    let server = support::serve(app).await;
    // Never stopped: 250 messages against a budget of 100.
    let seen = talk(connect(&server, "/upload").await, 250).await;
    assert_eq!(report(&mut reports).await.received, 250);
    assert_ne!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
    // Charged 250: 150 past the burst are owed, at 100/s, then one more message fits after
    // 10 ms.
    let client = support::client();
    clock.advance(Duration::from_millis(1_500));
    let refused = support::get(&client, &server.url("/unary"), &[]).await;
    assert_eq!(status_of(&refused), 429);
    clock.advance(Duration::from_millis(10));
    assert_eq!(status_of(&support::get(&client, &server.url("/unary"), &[]).await), 200);
}

#[tokio::test]
async fn a_concurrency_tier_holds_a_slot_while_the_socket_is_open() {
    let policy = Policy::builder("sockets")
        .tier("messages", Quota::per_second(100).counting(Unit::RequestMessages))
        .concurrency("open", Concurrency::new(1))
        .build()
        .unwrap();
    one_open_socket(policy).await;
}

#[tokio::test]
async fn a_concurrency_tier_holds_a_slot_while_the_socket_is_open_without_a_message_tier() {
    let policy =
        Policy::builder("sockets").concurrency("open", Concurrency::new(1)).build().unwrap();
    one_open_socket(policy).await;
}

/// With one slot per key, a second socket is refused while the first is open, and admitted
/// once it closed.
async fn one_open_socket(policy: Policy) {
    let layer = RateLimitLayer::builder(policy)
        .key(GlobalKey)
        .on_stream(StreamMode::Police)
        .build()
        .unwrap();
    let (app, mut reports) = app(layer);
    let server = support::serve(app).await;
    let url = format!("ws://{}/upload", server.addr);
    let mut first = connect(&server, "/upload").await;
    // The first socket's `101` went out long ago; its slot is still taken.
    first.send(ClientMessage::text("hello")).await.unwrap();
    assert_eq!(upgrade_refused(&url).await.0, 429);
    talk(first, 0).await;
    assert_eq!(report(&mut reports).await.received, 1);
    // Closed: the slot is free.
    let second = connect(&server, "/upload").await;
    talk(second, 3).await;
    assert_eq!(report(&mut reports).await.received, 3);
}

/// An upgrade whose handler never answers, ended by a timeout outside the layer: the unit its
/// request-bytes tier was charged at admission (a request of unknown length, policed) is
/// given back, as for any request that ends before its response.
#[tokio::test]
async fn an_upgrade_dropped_before_its_101_gives_back_its_streamed_bytes_unit() {
    use axum::response::IntoResponse;
    let store = frozen_memory();
    let policy = Policy::builder("stuck")
        .tier("bytes", Quota::per_minute(1_000).counting(Unit::RequestBytes))
        .tier("messages", Quota::per_second(100).counting(Unit::RequestMessages))
        .build()
        .unwrap();
    let layer = layer_of(policy, StreamMode::Police, store);
    let limiter = layer.limiter().clone();
    let timeout = tower::util::MapFutureLayer::new(
        |call: axum::routing::future::RouteFuture<std::convert::Infallible>| async move {
            let timed = tokio::time::timeout(Duration::from_millis(200), call).await;
            timed.unwrap_or_else(|_| Ok(http::StatusCode::REQUEST_TIMEOUT.into_response()))
        },
    );
    let stuck = |_up: WebSocketUpgrade, _budget: MessageBudget| std::future::pending::<Response>();
    let app = Router::new().route("/stuck", get(stuck)).route_layer(layer).layer(timeout);
    let server = support::serve(app).await;
    let url = format!("ws://{}/stuck", server.addr);
    assert_eq!(upgrade_refused(&url).await.0, 408);
    let peek = limiter.check(&Key::Global, 0).await.unwrap();
    assert_eq!(peek.tiers()[0].remaining(), 1_000, "the bytes tier is whole again");
    // The message charged at admission stays charged (an estimate, as for any request).
    assert_eq!(peek.tiers()[1].remaining(), 99);
}

/// Settling: a handler that takes the budget but answers without upgrading keeps the
/// message its request was charged at admission, as any request does (nothing was counted
/// on a socket, so nothing settles it).
#[tokio::test]
async fn settling_an_upgrade_that_never_became_a_socket_keeps_its_admission_charge() {
    let layer = layer(Unit::RequestMessages, StreamMode::Settle, frozen_memory());
    let limiter = layer.limiter().clone();
    let refuse = |_up: WebSocketUpgrade, _budget: MessageBudget| async { "no socket today" };
    let app = Router::new().route("/refuse", get(refuse)).route_layer(layer);
    let server = support::serve(app).await;
    let url = format!("ws://{}/refuse", server.addr);
    assert_eq!(upgrade_refused(&url).await.0, 200);
    let peek = limiter.check(&Key::Global, 0).await.unwrap();
    assert_eq!(peek.tiers()[0].remaining(), 99);
}

/// Shapes 300 messages at 100/s after a burst of 100 on the real clock, in the direction of
/// `unit`: what the client saw, what the handler did, how long it took.
async fn shaped(unit: Unit, path: &str, sends: u64) -> (Seen, Done, Duration) {
    let (app, mut reports) = app(layer(unit, StreamMode::Shape, MemoryStore::new()));
    let server = support::serve(app).await;
    let client = connect(&server, path).await;
    let start = Instant::now();
    let seen = talk(client, sends).await;
    let done = report(&mut reports).await;
    let elapsed = start.elapsed();
    assert_eq!(done.spent, None);
    assert_ne!(seen.close.as_ref().map(|c| c.code), Some(CloseCode::Policy));
    // (300 - 100) / 100 per second = 2 s, give or take the grant of 16 taken ahead of the
    // last message.
    assert!(elapsed >= Duration::from_millis(1_900), "{elapsed:?}");
    assert!(elapsed <= Duration::from_millis(2_600), "{elapsed:?}");
    (seen, done, elapsed)
}

#[tokio::test]
async fn shaping_paces_the_messages_received() {
    let (_, done, _) = shaped(Unit::RequestMessages, "/upload", 300).await;
    assert_eq!(done.received, 300);
}

#[tokio::test]
async fn shaping_paces_the_messages_sent() {
    let (seen, done, _) = shaped(Unit::ResponseMessages, "/download/300", 0).await;
    assert_eq!((seen.texts, done.sent), (300, 300));
}

#[tokio::test]
async fn a_handler_asking_for_a_budget_without_a_layer_in_front_gets_a_500() {
    let (app, _reports) = served(routes());
    let body = upgrade_refused_with_500(app, "/upload").await;
    assert!(body.starts_with("no message budget"), "{body}");
}

#[tokio::test]
async fn a_layer_counting_no_messages_gives_a_budget_that_meters_nothing() {
    let policy =
        Policy::builder("requests").tier("requests", Quota::per_second(100)).build().unwrap();
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).build().unwrap();
    let (app, mut reports) = app(layer);
    let server = support::serve(app).await;
    let seen = talk(connect(&server, "/upload").await, 300).await;
    let done = report(&mut reports).await;
    assert_eq!((done.received, done.spent), (300, None));
    assert_ne!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
}

#[tokio::test]
async fn stacked_layers_each_charge_every_message() {
    let clock = FakeClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let layer = |name, count| {
        let policy = messages_per_second(name, count, Unit::RequestMessages);
        layer_of(policy, StreamMode::Police, store.clone())
    };
    let (outer, inner) = (layer("outer", 100), layer("inner", 50));
    let outer_limiter = outer.limiter().clone();
    let (app, mut reports) = served(routes().route_layer(inner).route_layer(outer));
    let server = support::serve(app).await;
    let seen = talk(connect(&server, "/upload").await, 300).await;
    // The inner layer's 50 run out first.
    assert_eq!(report(&mut reports).await.received, 50);
    assert_eq!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
    // The outer layer was charged the same 50, the rest of its grant given back.
    let left = outer_limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
    assert_eq!(left, 50);
}

/// A socket within the budget is charged exactly its messages (the unused part of its last
/// grant comes back when it is dropped), and one past it gets exactly what is left; the tier
/// refills one message every 36 s, so nothing refills meanwhile.
async fn a_socket_is_charged_exactly_its_messages<St: Store>(store: St) {
    let policy = Policy::builder("slow")
        .tier("messages", Quota::per_hour(100).counting(Unit::RequestMessages))
        .build()
        .unwrap();
    let layer = layer_of(policy, StreamMode::Police, store);
    let limiter = layer.limiter().clone();
    let (app, mut reports) = app(layer);
    let server = support::serve(app).await;
    // The settlement of the last grant may still be on its way to a remote store (on a
    // loaded machine, for a while): read until it says `expected`, at most 10 s.
    let left = |expected: u64| {
        let limiter = limiter.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
                if left == expected || std::time::Instant::now() > deadline {
                    return left;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // 40 messages: the first charged with the upgrade, then three grants of 16, nine of them
    // unused and given back.
    talk(connect(&server, "/upload").await, 40).await;
    assert_eq!(report(&mut reports).await.received, 40);
    assert_eq!(left(60).await, 60);
    let seen = talk(connect(&server, "/upload").await, 1_000).await;
    assert_eq!(report(&mut reports).await.received, 60);
    assert_eq!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
    assert_eq!(left(0).await, 0);
}

support::stores::store_tests! {
    #[tokio::test]
    a_socket_is_charged_exactly_its_messages_in_memory: a_socket_is_charged_exactly_its_messages(support::stores::on_system_clock());
    #[cfg(feature = "redis")]
    a_socket_is_charged_exactly_its_messages_on_redis: a_socket_is_charged_exactly_its_messages(support::stores::redis::server("redis-server", "websocket:"));
    #[cfg(feature = "redis")]
    a_socket_is_charged_exactly_its_messages_on_a_redis_cluster: a_socket_is_charged_exactly_its_messages(support::stores::redis::cluster("websocket:"));
}

/// A layer with no stream setting polices a socket's messages as it polices requests: a
/// client sending 50 messages against a tier of 10 (the clock stands still) has exactly 10
/// delivered, then the socket is closed with 1008.
#[tokio::test]
async fn a_message_tier_is_policed_by_default() {
    let (server, mut reports) =
        serve_frozen(messages_per_second("chat", 10, Unit::RequestMessages)).await;
    let seen = talk(connect(&server, "/upload").await, 50).await;
    assert_eq!(report(&mut reports).await.received, 10);
    assert_eq!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
}

/// A socket that stays within its tier of 10 messages (whose first breach would block the
/// key for 10 minutes) is never boxed by the grants its stream asked for: 5 messages sent,
/// 5 delivered, no Close from the server; the key's next socket is admitted too.
#[tokio::test]
async fn a_socket_within_its_budget_never_trips_the_penalty_box() {
    let policy = Policy::builder("chat")
        .tier("messages", Quota::per_hour(10).counting(Unit::RequestMessages))
        .penalty("messages", tollgate::Penalty::new(Duration::from_secs(600)))
        .build()
        .unwrap();
    let (server, mut reports) = serve_frozen(policy).await;
    let seen = talk(connect(&server, "/upload").await, 5).await;
    let done = report(&mut reports).await;
    assert_eq!((done.received, done.spent.is_none()), (5, true));
    assert_ne!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
    // 5 of 10 used: the next socket is admitted and gets what is left.
    let seen = talk(connect(&server, "/upload").await, 20).await;
    assert_eq!(report(&mut reports).await.received, 5);
    assert_eq!(seen.close.map(|c| c.code), Some(CloseCode::Policy));
}

/// A route whose policy counts messages but whose handler upgrades without taking the
/// `MessageBudget`: its socket could not be metered, so the upgrade is refused with a 500
/// (logged once and counted), instead of letting every message through.
#[tokio::test]
async fn an_upgrade_whose_handler_does_not_meter_its_socket_is_refused() {
    let policy = messages_per_second("unmetered-chat", 5, Unit::RequestMessages);
    let layer = layer_of_frozen(policy);
    let echo = |up: WebSocketUpgrade| async move {
        up.on_upgrade(|mut socket| async move {
            while let Some(Ok(message)) = socket.recv().await {
                if socket.send(message).await.is_err() {
                    break;
                }
            }
        })
    };
    let app = Router::new().route("/echo", get(echo)).route_layer(layer);
    let body = upgrade_refused_with_500(app, "/echo").await;
    assert!(body.contains("does not meter the socket"), "{body}");
}
