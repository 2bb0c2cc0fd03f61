//! WebSocket messages as a tier's unit (cargo feature `ws`), for axum.
//!
//! A tier counting [`Unit::RequestMessages`](crate::Unit) or
//! [`Unit::ResponseMessages`](crate::Unit) limits the messages of a WebSocket in each
//! direction, sharing one budget with the unary calls (and gRPC streams) of the same key. An
//! upgraded connection is out of the layer's sight, so the layer hands the handler a
//! [`MessageBudget`] (an axum extractor) and the handler wraps its socket with it; the
//! [`MeteredWebSocket`] it gets is charged in grants of at most
//! [`MESSAGE_GRANT`](crate::StreamMode::MESSAGE_GRANT) messages, shaped (the next message waits) or
//! policed (a Close frame with code 1008 and the seconds to wait) by the layer's
//! [`StreamMode`](crate::StreamMode). See [how it works](#how-it-works) for what the client
//! sees.
//!
//! # How it works
//!
//! [`RateLimitLayer`](crate::RateLimitLayer) puts a [`MessageBudget`] in the extensions of each
//! request it lets through that asks for a WebSocket upgrade (an `Upgrade: websocket` header, or
//! HTTP/2's extended `CONNECT`, RFC 8441): metering the socket when the request was admitted
//! under a policy with a tier counting [`Unit::RequestMessages`](crate::Unit::RequestMessages) or
//! [`Unit::ResponseMessages`](crate::Unit::ResponseMessages), and metering nothing otherwise (see
//! [`is_metered`](MessageBudget::is_metered)). Stacked layers each add their tiers to the one
//! budget: a message is charged to all of them. The layer cannot see the messages of an upgraded
//! connection: the handler wraps its socket with [`wrap`](MessageBudget::wrap), and the
//! [`MeteredWebSocket`] it gets charges each Text or Binary message it receives to the tiers
//! counting `RequestMessages` and each it sends to those counting `ResponseMessages` (Ping, Pong
//! and Close frames are not counted). An upgrade whose handler does not take the budget is refused
//! with a `500` (logged once, counted in `tollgate_config_warnings_total`): its socket could not be
//! metered.
//!
//! The upgrade request itself is admitted as a unary call is, and charged one message each way (a
//! key that has spent its tier gets a `429` to the upgrade); those are the first message each way
//! on the socket. The messages then share the key's budget with its unary calls and its other
//! sockets, and are charged in grants of at most
//! [`MESSAGE_GRANT`](crate::StreamMode::MESSAGE_GRANT) (16) messages, exactly as a gRPC stream's;
//! the unused part of the last grant is given back when the socket is dropped. The socket is
//! metered as the layer decides requests (see [`StreamMode`](crate::StreamMode)); what happens when
//! a tier has no room for the next message:
//!
//! - [`StreamMode::Shape`](crate::StreamMode::Shape): the next message waits. Receiving, the socket
//!   is not read any more (TCP flow control slows the client); sending,
//!   [`poll_ready`](futures_sink::Sink::poll_ready) (and [`MeteredWebSocket::send`]) waits.
//! - [`StreamMode::Police`](crate::StreamMode::Police): the socket sends a Close frame with code
//!   1008 (policy violation, RFC 6455 §7.4.1) and the reason `rate limited; retry-after=N`, `N`
//!   being the seconds (rounded up, at least 1) until the tier has room for the grant it refused,
//!   then ends (see [`MeteredWebSocket`]). The message past the budget is not delivered, so the
//!   handler receives (and the client receives) exactly the messages the tier admits.
//! - [`StreamMode::Settle`](crate::StreamMode::Settle), and a
//!   [dry run](crate::RateLimitLayerBuilder::dry_run): the socket is never slowed nor stopped; its
//!   messages are counted, and the message each way charged at admission is settled at the count
//!   when the socket ends (what it used past the tier is owed by the key's next requests).
//!
//! Code 1008 rather than 1013 (try again later, IANA WebSocket close code registry): the client
//! sent, or asked for, more than its policy allows, which is what 1008 says; 1013 describes a
//! server-side condition, and is what a socket gets when the store cannot decide and the layer
//! fails closed ([`on_store_error`](crate::RateLimitLayerBuilder::on_store_error)); failing open
//! lets the grant through uncharged.
//!
//! The upgrade request is held until its socket ends: when the `101` response has been sent and the
//! budget and every [`MeteredWebSocket`] wrapped with it are dropped. A
//! [concurrency](crate::Concurrency) tier's slot ("at most 5 open sockets per key") is taken for
//! that long, under a policy counting messages or not. Under a policy counting no messages, a
//! handler that does not take the budget ends the request with its `101` response.

pub use crate::layer::websocket::{BudgetSpent, MessageBudget, MeteredWebSocket, MissingBudget};
