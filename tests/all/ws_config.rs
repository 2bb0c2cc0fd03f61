//! WebSocket message tiers served from a configuration file, and reloaded while a socket is
//! open: the seam between the config layer (`LimitsLayer`, its reloads) and the metering of
//! WebSocket messages through the `MessageBudget` each rule's layer hands the handler.
#![cfg(all(feature = "ws", feature = "config"))]

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::response::Response;
use axum::routing::get;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message as ClientMessage;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tollgate::clock::FakeClock;
use tollgate::config::{LimitsConfig, LimitsLayer};
use tollgate::store::MemoryStore;
use tollgate::ws::MessageBudget;

/// The Text messages a handler received before its socket ended.
type Reports = mpsc::UnboundedSender<u64>;

/// Reads every message until the socket ends (or the budget stops it), counting Text ones.
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
        drop((socket, budget));
        let _ = done.send(received);
    })
}

/// `count` messages received an hour on one key for every request on `/upload` and `/unary`,
/// policed as the messages stream; `/free` is limited by no rule.
fn config(count: u64, name: &str) -> LimitsConfig {
    let text = format!(
        r#"
[policies.sockets]
tiers = [{{ name = "messages", count = {count}, period = "1h", unit = "request_messages" }}]

[[rules]]
name = "sockets"
paths = ["/upload", "/unary"]
key = "global"
policy = "sockets"
on_stream = "police"
"#
    );
    LimitsConfig::from_toml(&text, name).unwrap()
}

/// The app behind a `LimitsLayer` of `config(count)` on a store whose clock stands still
/// (nothing refills while the test runs): the layer, the server, the handlers' reports.
async fn served(
    count: u64,
) -> (LimitsLayer<MemoryStore>, support::Server, mpsc::UnboundedReceiver<u64>) {
    let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
    let layer = LimitsLayer::with_store(config(count, "v1.toml"), store).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let app = Router::new()
        .route("/upload", get(upload))
        .route("/unary", get(|| async { "ok" }))
        .route("/free", get(|| async { "free" }))
        .layer(layer.clone())
        .with_state(tx);
    (layer, support::serve(app).await, rx)
}

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(server: &support::Server) -> Client {
    let url = format!("ws://{}/upload", server.addr);
    tokio_tungstenite::connect_async(url).await.expect("upgrade").0
}

/// Sends `n` Text messages, then closes (unless the server closed first) and reads until the
/// connection ends: the server's Close code, if it sent one.
async fn talk(client: Client, n: u64) -> Option<CloseCode> {
    let (mut tx, mut rx) = client.split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            if tx.send(ClientMessage::text(i.to_string())).await.is_err() {
                return;
            }
        }
        let _ = tx.send(ClientMessage::Close(None)).await;
    });
    let mut close = None;
    let read = async {
        while let Some(message) = rx.next().await {
            match message {
                Ok(ClientMessage::Close(frame)) => close = frame.map(|f| f.code),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.expect("the connection ends");
    sender.await.unwrap();
    close
}

/// Sends `n` Text messages on an open socket without closing it.
async fn send(client: &mut Client, n: u64) {
    for i in 0..n {
        client.send(ClientMessage::text(i.to_string())).await.unwrap();
    }
}

async fn report(reports: &mut mpsc::UnboundedReceiver<u64>) -> u64 {
    tokio::time::timeout(Duration::from_secs(10), reports.recv())
        .await
        .expect("the handler ends")
        .expect("a report")
}

async fn status(server: &support::Server, path: &str) -> u16 {
    support::get(&support::client(), &server.url(path), &[]).await.status.as_u16()
}

/// How many unary requests on `/unary` are admitted before the first 429 (at most `max`).
async fn admitted_unary(server: &support::Server, max: u64) -> u64 {
    for n in 0..max {
        if status(server, "/unary").await != 200 {
            return n;
        }
    }
    max
}

#[tokio::test]
async fn a_message_tier_from_the_file_polices_a_socket_exactly() {
    let (_layer, server, mut reports) = served(100).await;
    let close = talk(connect(&server).await, 300).await;
    assert_eq!(report(&mut reports).await, 100);
    assert_eq!(close, Some(CloseCode::Policy));
    // The budget is spent for plain requests of the key too; a route no rule limits is not.
    assert_eq!(status(&server, "/unary").await, 429);
    assert_eq!(status(&server, "/free").await, 200);
}

#[tokio::test]
async fn a_socket_open_across_a_reload_keeps_the_budget_it_started_with() {
    let (layer, server, mut reports) = served(100).await;
    let mut client = connect(&server).await;
    send(&mut client, 50).await;
    // The quota changes while the socket is open: the socket goes on under the configuration
    // it started with, so it gets the other 50 of its 100 and is closed with 1008.
    let reloaded = layer.handle().reload(config(200, "v2.toml")).unwrap();
    assert_eq!(reloaded.changed(), &["sockets".to_owned()][..]);
    let close = talk(client, 250).await;
    assert_eq!(report(&mut reports).await, 100);
    assert_eq!(close, Some(CloseCode::Policy));
    // A socket after the reload starts from the changed quota's full budget (start_full).
    let close = talk(connect(&server).await, 300).await;
    assert_eq!(report(&mut reports).await, 200);
    assert_eq!(close, Some(CloseCode::Policy));
}

#[tokio::test]
async fn a_reload_that_keeps_the_policy_keeps_one_budget_for_the_socket_and_new_requests() {
    let (layer, server, mut reports) = served(100).await;
    let mut client = connect(&server).await;
    send(&mut client, 40).await;
    // An unchanged policy keeps its limiter: the socket opened before the reload and the plain
    // requests after it spend one budget.
    let reloaded = layer.handle().reload(config(100, "v2.toml")).unwrap();
    assert_eq!(reloaded.kept(), &["sockets".to_owned()][..]);
    let close = talk(client, 0).await;
    assert_ne!(close, Some(CloseCode::Policy));
    assert_eq!(report(&mut reports).await, 40);
    assert_eq!(admitted_unary(&server, 200).await, 60);
}
