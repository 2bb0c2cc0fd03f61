//! Warnings said once per process: a setting read but not acted on is logged, once.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// Logs `message` at warn level the first time `id` is seen.
pub(crate) fn warn(id: &str, message: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    let first =
        seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id.to_owned());
    if first {
        tracing::warn!("{message}");
    }
}
