//! WebSocket messages as a tier's unit (cargo feature `ws`), for axum.
//!
//! A tier counting [`Unit::RequestMessages`](crate::Unit) or
//! [`Unit::ResponseMessages`](crate::Unit) limits the messages of a WebSocket in each
//! direction, sharing one budget with the unary calls (and gRPC streams) of the same key. An
//! upgraded connection is out of the layer's sight, so the layer hands the handler a
//! [`MessageBudget`] (an axum extractor) and the handler wraps its socket with it; the
//! [`MeteredWebSocket`] it gets is charged in leases of at most
//! [`MESSAGE_LEASE`](crate::StreamMode::MESSAGE_LEASE) messages, shaped (the next message waits) or
//! policed (a Close frame with code 1008 and the seconds to wait) by the layer's
//! [`StreamMode`](crate::StreamMode). See [`MessageBudget`] for what the client sees.

pub use crate::layer::websocket::{BudgetSpent, MessageBudget, MeteredWebSocket, MissingBudget};
