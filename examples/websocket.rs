//! Messages on a WebSocket limited per API key: an axum echo endpoint behind the layer, and
//! a client in the same process talking to it over a loopback port.
//!
//! The tier counts the messages each client sends (Text and Binary; pings, pongs and closes
//! are free): a burst of 100, then 10 a minute, per `x-api-key`, shared with the key's plain
//! HTTP requests. The layer cannot see the messages of an upgraded connection, so the handler
//! takes a `MessageBudget` and wraps its socket with it. Policed, alice sends 300 messages at
//! once: the handler gets (and echoes) exactly her 100, then the socket closes with code 1008
//! and `rate limited; retry-after=N`, and her next plain request is refused with a 429. Bob,
//! another key, chats within his budget and closes normally.
//!
//! Exits non-zero when a count is not the one expected.
//!
//! Run with `cargo run --example websocket --features ws`.

use std::time::Duration;

use axum::Router;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::response::Response;
use axum::routing::get;
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::HeaderName;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message as ClientMessage};
use tollgate::key::HeaderKey;
use tollgate::ws::MessageBudget;
use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};

/// Echoes each Text message until the client closes, or policing does.
async fn chat(up: WebSocketUpgrade, budget: MessageBudget) -> Response {
    up.on_upgrade(move |socket| async move {
        let mut socket = budget.wrap(socket);
        while let Some(Ok(message)) = socket.recv().await {
            if let Message::Text(text) = message {
                if socket.send(Message::Text(text)).await.is_err() {
                    break;
                }
            }
        }
        if let Some(spent) = socket.spent() {
            println!("server: closed a socket: {spent}");
        }
    })
}

/// What a client saw: the echoes, and the server's Close frame, if it closed first.
struct Seen {
    echoes: u64,
    close: Option<(CloseCode, String)>,
}

/// Connects as `key`, sends `n` messages at once while reading the echoes, closes, and reads
/// until the connection ends.
async fn talk(addr: &str, key: &str, n: u64) -> Result<Seen, Box<dyn std::error::Error>> {
    let mut req = format!("ws://{addr}/chat").into_client_request()?;
    req.headers_mut().insert("x-api-key", key.parse()?);
    let (socket, _) = tokio_tungstenite::connect_async(req).await?;
    let (mut tx, mut rx) = socket.split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            // Refused once the server's Close came in.
            if tx.send(ClientMessage::text(format!("message {i}"))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(ClientMessage::Close(None)).await;
    });
    let mut seen = Seen { echoes: 0, close: None };
    let read = async {
        while let Some(message) = rx.next().await {
            match message {
                Ok(ClientMessage::Text(_)) => seen.echoes += 1,
                Ok(ClientMessage::Close(Some(frame))) => {
                    seen.close = Some((frame.code, frame.reason.as_str().to_owned()));
                }
                Ok(_) => {}
                Err(tungstenite::Error::ConnectionClosed) => break,
                Err(error) => return Err(error),
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), read).await??;
    sender.await?;
    Ok(seen)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let policy = Policy::builder("chat")
        .tier("messages", Quota::per_minute(10).with_burst(100).counting(Unit::RequestMessages))
        .build()?;
    let layer = RateLimitLayer::builder(policy)
        .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
        .on_stream(StreamMode::Police)
        .build()?;
    let app = Router::new()
        .route("/chat", get(chat))
        .route("/status", get(|| async { "up" }))
        .route_layer(layer);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let alice = talk(&addr, "alice", 300).await?;
    println!(
        "alice: sent 300 messages at once, {} echoed, closed with {:?}",
        alice.echoes, alice.close
    );
    assert_eq!(alice.echoes, 100, "alice's budget is 100 messages");
    let (code, reason) = alice.close.ok_or("alice's socket was not closed by the server")?;
    assert_eq!(code, CloseCode::Policy);
    assert!(reason.starts_with("rate limited; retry-after="), "{reason}");

    // Her plain requests share the budget.
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let req = http::Request::get(format!("http://{addr}/status"))
        .header("x-api-key", "alice")
        .body(Empty::new())?;
    let status = client.request(req).await?.status();
    println!("alice: GET /status: {status}");
    assert_eq!(status, http::StatusCode::TOO_MANY_REQUESTS);

    let bob = talk(&addr, "bob", 50).await?;
    println!("bob: sent 50 messages, {} echoed, closed with {:?}", bob.echoes, bob.close);
    assert_eq!(bob.echoes, 50);
    assert_ne!(bob.close.map(|(code, _)| code), Some(CloseCode::Policy));
    Ok(())
}
