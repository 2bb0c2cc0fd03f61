//! Calendar windows that reach a key's clock guard. This process computes the calendar windows
//! a check or settlement needs (Lua has no time zone data) around its own clock, 60 s either
//! side, and a key decides at the later of now and its clock guard (the instant of its last
//! charge). After the clock steps back more than 60 s behind a key's guard, the windows sent
//! miss the key's instant: the script then stops before it changes anything, naming that
//! instant (`lua/cover.lua`), and the call is sent again with windows reaching it, as do the
//! policy's next calls while that instant lies ahead (at most 10,000 windows: a step back
//! further than that, a week of minute windows, still fails the call). A server clock more
//! than 60 s ahead of this process's is reached the same way; one more than 60 s behind still
//! fails the call (the windows sent start 60 s before this process's clock).

use super::Inner;
use super::script::Prepared;
use crate::error::StoreError;

/// Calls sent again with wider windows before the error is returned.
const RETRIES: usize = 2;

/// What the script's error names: `calendar windows needed at {seconds} s`.
const NEEDED: &str = "calendar windows needed at ";

/// The instant (nanoseconds since the epoch) that `error` says a script needed windows for.
fn needed(error: &StoreError) -> Option<u64> {
    let StoreError::Backend(e) = error else { return None };
    let text = e.to_string();
    let rest = &text[text.find(NEEDED)? + NEEDED.len()..];
    let digits = rest.find(|c: char| !c.is_ascii_digit()).map_or(rest, |end| &rest[..end]);
    let seconds: u64 = digits.parse().ok()?;
    // The end of that second: the key's instant lies within it.
    seconds.checked_add(1)?.checked_mul(1_000_000_000)
}

impl Inner {
    /// [`submit_once`](Self::submit_once), sent again with calendar windows that reach the
    /// key's instant when the script names one they missed.
    pub(super) async fn submit(
        &self,
        prepared: &Prepared,
        keys: Vec<String>,
        record: Vec<f64>,
        reply_len: usize,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        if !prepared.has_calendars() {
            return self.submit_once(prepared, keys, record, reply_len).await;
        }
        let mut record = record;
        for _ in 0..RETRIES {
            let answer = self.submit_once(prepared, keys.clone(), record.clone(), reply_len).await;
            let Some(need) = answer.as_ref().err().and_then(needed) else { return answer };
            match prepared.rebound(&record, self.app_now(), need) {
                Some(again) => record = again,
                None => return answer,
            }
        }
        self.submit_once(prepared, keys, record, reply_len).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instant_is_read_from_the_script_error() {
        let e = StoreError::backend(
            "An error was signalled by the server - ResponseError: user_script:9: tollgate: \
             calendar windows needed at 1748736000 s script: 82664e",
        );
        assert_eq!(needed(&e), Some(1_748_736_001_000_000_000));
        assert_eq!(
            needed(&StoreError::backend("tollgate: the calendar windows sent do not")),
            None
        );
        assert_eq!(needed(&StoreError::backend("calendar windows needed at x s")), None);
    }
}
