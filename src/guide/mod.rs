//! Guides: one page per task, each with a complete program that CI compiles and runs.
//!
//! The README says what tollgate is and how to choose; these pages say how to do each thing.
//! Mechanism, defaults and bounds live in the rustdoc of the items each page links to.
//!
//! | task | page | features | the program CI runs |
//! |---|---|---|---|
//! | limit some routes, each with its own budget | [per_route](per_route/index.html) | `axum` | the page's example |
//! | plans per customer, allow-lists, what is not limited | [plans](plans/index.html) | `axum` | the page's example |
//! | key clients behind a proxy or load balancer | [behind_a_proxy](behind_a_proxy/index.html) |  | the page's example |
//! | serve with plain hyper, no axum | [hyper](hyper/index.html) |  | the page's example |
//! | a login guard: only failures count, a penalty box, nothing told to the attacker | [login_guard](login_guard/index.html) | `axum` | the page's example; `cargo run --example login_guard` |
//! | concurrency, bytes, tokens, monthly quotas, penalty boxes, reserves | [tier_kinds](tier_kinds/index.html) |  | the page's example; `cargo run --example billing` |
//! | uploads: body-size limits and bandwidth per key | [uploads](uploads/index.html) | `axum` | the page's examples; `cargo run --example bandwidth` |
//! | gRPC with tonic: calls and stream messages | [grpc](grpc/index.html) | `tonic` | the page's examples; `cargo run --example grpc --features tonic,client`; `cargo run --example grpc_messages --features tonic` |
//! | WebSocket messages per key | [websocket](websocket/index.html) | `ws` | `cargo run --example websocket --features ws` |
//! | one limit for a fleet: Redis, Cluster, Sentinel | [redis](redis/index.html) | `redis` | `cargo run --example redis --features redis` |
//! | hot keys past one Redis: lease mode | [leases](leases/index.html) | `redis` | the page's example; `cargo run --example fleet --features redis` |
//! | limits from a TOML file, reloaded while serving | [config_file](config_file/index.html) | `config` | `cargo run --example config --features config` |
//! | testing your app's limits | [testing](testing/index.html) | `testing`, `axum` | the page's examples (one is the body of the test `testing::monthly_quota_resets_at_midnight_in_berlin`) |
//! | calling a rate-limited API | [client](client/index.html) | `client`, `axum` | the page's example |
//! | metrics, decision hook, dry run, logs | [observability](observability/index.html) |  | the page's example; `cargo run --example demo` |
//! | limits in code, not HTTP | [limits_in_code](limits_in_code/index.html) |  | the page's example |
//!
//! A page's example is a doctest: `cargo test --all-features --doc` runs it. The examples
//! under `examples/` start what they need (a throw-away `redis-server` for the Redis ones) and
//! exit by themselves; `.ci/run` runs each.

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[doc = include_str!("per_route.md")]
pub mod per_route {}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[doc = include_str!("plans.md")]
pub mod plans {}

#[doc = include_str!("behind_a_proxy.md")]
pub mod behind_a_proxy {}

#[doc = include_str!("hyper.md")]
pub mod hyper {}

#[doc = include_str!("tier_kinds.md")]
pub mod tier_kinds {}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[doc = include_str!("login_guard.md")]
pub mod login_guard {}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[doc = include_str!("uploads.md")]
pub mod uploads {}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
#[doc = include_str!("grpc.md")]
pub mod grpc {}

#[cfg(feature = "ws")]
#[cfg_attr(docsrs, doc(cfg(feature = "ws")))]
#[doc = include_str!("websocket.md")]
pub mod websocket {}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc = include_str!("redis.md")]
pub mod redis {}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc = include_str!("leases.md")]
pub mod leases {}

#[cfg(feature = "config")]
#[cfg_attr(docsrs, doc(cfg(feature = "config")))]
#[doc = include_str!("config_file.md")]
pub mod config_file {}

#[cfg(all(feature = "testing", feature = "axum"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "testing", feature = "axum"))))]
#[doc = include_str!("testing.md")]
pub mod testing {}

#[cfg(all(feature = "client", feature = "axum"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "client", feature = "axum"))))]
#[doc = include_str!("client.md")]
pub mod client {}

#[doc = include_str!("observability.md")]
pub mod observability {}

#[doc = include_str!("limits_in_code.md")]
pub mod limits_in_code {}
