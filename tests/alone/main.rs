//! The tests that must not share the machine with other tests: a second test binary, which
//! cargo runs after (never beside) `tests/all`, and whose tests take [`ONE_AT_A_TIME`] so that
//! they also run one at a time among themselves.
//!
//! Why not in `tests/all` behind a lock: a lock orders only the tests that take it, and the
//! other tests of a binary run beside them. These tests would disturb the others, or be
//! disturbed by them: `redis_busy` keeps both cores busy on purpose; `flood` measures the
//! resident memory of its process; `faults` and `sentinel` bound every request's latency
//! under load (the store's timeout plus 250 ms) on a 2-core machine; `redis_load` measures
//! Redis CPU per check and decides thousands of concurrent checks at the default timeout.

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod flood;
mod outage;
mod redis_busy;
mod redis_load;
mod sentinel;
mod sentinel_slots;

/// Taken by every test of this binary for its whole run.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
