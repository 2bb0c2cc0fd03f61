//! WebSocket message tiers served from a configuration file, and reloaded while a socket is
//! open: the seam between the config layer (`LimitsLayer`, its reloads) and the metering of
//! WebSocket messages through the `MessageBudget` each rule's layer hands the handler.
#![cfg(all(feature = "ws", feature = "config"))]

use crate::support;

use axum::routing::get;
use futures_util::SinkExt;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message as ClientMessage;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tollgate::config::{LimitsConfig, LimitsLayer, Reloaded};
use tollgate::store::MemoryStore;

use crate::websocket::{Client, Done, connect, report, routes, served as with_reports, talk};

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

/// The WebSocket tests' routes (and `/free`) behind a `LimitsLayer` of `config(count)` on a
/// store whose clock stands still (nothing refills while the test runs): the layer, the
/// server, the handlers' reports.
async fn served(
    count: u64,
) -> (LimitsLayer<MemoryStore>, support::Server, mpsc::UnboundedReceiver<Done>) {
    let store = support::stores::frozen_memory();
    let layer = LimitsLayer::with_store(config(count, "v1.toml"), store).unwrap();
    let routes = routes().route("/free", get(|| async { "free" })).layer(layer.clone());
    let (app, reports) = with_reports(routes);
    (layer, support::serve(app).await, reports)
}

/// The server's Close code when `client` has sent `n` Text messages.
async fn close_after(client: Client, n: u64) -> Option<CloseCode> {
    talk(client, n).await.close.map(|c| c.code)
}

/// Sends `n` Text messages on an open socket without closing it.
async fn send(client: &mut Client, n: u64) {
    for i in 0..n {
        client.send(ClientMessage::text(i.to_string())).await.unwrap();
    }
}

/// The Text messages the handler received before its socket ended.
async fn received(reports: &mut mpsc::UnboundedReceiver<Done>) -> u64 {
    report(reports).await.received
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

/// [`served`] at 100 an hour, a socket open on `/upload` that has sent `sent` messages, then
/// the configuration reloaded to `count` an hour: the server, the handlers' reports, the open
/// socket, and what the reload did.
async fn reloaded_with_a_socket_open(
    sent: u64,
    count: u64,
) -> (support::Server, mpsc::UnboundedReceiver<Done>, Client, Reloaded) {
    let (layer, server, reports) = served(100).await;
    let mut client = connect(&server, "/upload").await;
    send(&mut client, sent).await;
    let reloaded = layer.handle().reload(config(count, "v2.toml")).unwrap();
    (server, reports, client, reloaded)
}

#[tokio::test]
async fn a_message_tier_from_the_file_polices_a_socket_exactly() {
    let (_layer, server, mut reports) = served(100).await;
    let close = close_after(connect(&server, "/upload").await, 300).await;
    assert_eq!(received(&mut reports).await, 100);
    assert_eq!(close, Some(CloseCode::Policy));
    // The budget is spent for plain requests of the key too; a route no rule limits is not.
    assert_eq!(status(&server, "/unary").await, 429);
    assert_eq!(status(&server, "/free").await, 200);
}

#[tokio::test]
async fn a_socket_open_across_a_reload_keeps_the_budget_it_started_with() {
    // The quota changes while the socket is open: the socket goes on under the configuration
    // it started with, so it gets the other 50 of its 100 and is closed with 1008.
    let (server, mut reports, client, reloaded) = reloaded_with_a_socket_open(50, 200).await;
    assert_eq!(reloaded.changed(), &["sockets".to_owned()][..]);
    let close = close_after(client, 250).await;
    assert_eq!(received(&mut reports).await, 100);
    assert_eq!(close, Some(CloseCode::Policy));
    // A socket after the reload starts from the changed quota's full budget (start_full).
    let close = close_after(connect(&server, "/upload").await, 300).await;
    assert_eq!(received(&mut reports).await, 200);
    assert_eq!(close, Some(CloseCode::Policy));
}

#[tokio::test]
async fn a_reload_that_keeps_the_policy_keeps_one_budget_for_the_socket_and_new_requests() {
    // An unchanged policy keeps its limiter: the socket opened before the reload and the plain
    // requests after it spend one budget.
    let (server, mut reports, client, reloaded) = reloaded_with_a_socket_open(40, 100).await;
    assert_eq!(reloaded.kept(), &["sockets".to_owned()][..]);
    let close = close_after(client, 0).await;
    assert_ne!(close, Some(CloseCode::Policy));
    assert_eq!(received(&mut reports).await, 40);
    assert_eq!(admitted_unary(&server, 200).await, 60);
}
