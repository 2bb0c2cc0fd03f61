//! Moved to the [`guide`](crate::guide): one page per task, each with a program CI runs.
//!
//! Where each recipe went:
//!
//! | recipe | guide page |
//! |---|---|
//! | Per-route limits in axum | `guide::per_route` |
//! | A hyper server without axum | [`guide::hyper`](crate::guide::hyper) |
//! | tonic | `guide::grpc` (feature `tonic`) |
//! | Behind a load balancer | [`guide::behind_a_proxy`](crate::guide::behind_a_proxy) |
//! | Per-plan limits | `guide::plans` |
//! | Limits in code, not HTTP | [`guide::limits_in_code`](crate::guide::limits_in_code) |
//! | Testing your own app with a fake clock | `guide::testing` (features `testing`, `axum`) |
//! | Calling a rate-limited API | `guide::client` (features `client`, `axum`) |
//! | Redis and Redis Cluster | `guide::redis` (feature `redis`) |
//! | Seeing what the limiter does | [`guide::observability`](crate::guide::observability) |
