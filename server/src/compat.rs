//! Fixed windows on Redis in envoyproxy/ratelimit's key layout, so that both services can
//! share one Redis and count on the same keys.
//!
//! The reference names a window's counter
//! `<CACHE_KEY_PREFIX><domain>_<key1>_<value1>_..._<keyN>_<valueN>_<window start>`, the window
//! start being the Unix time in seconds rounded down to a multiple of the unit (a month is 30
//! days, a year 365), and keeps the count as a plain integer (`INCRBY`), expiring after the
//! unit plus a random jitter (`EXPIRATION_JITTER_MAX_SECONDS`). Where a wildcard descriptor
//! has `share_threshold`, the pattern stands for the value.
//!
//! This service reads and writes the same keys with one script per descriptor: it adds the
//! hits only when they fit (`count + hits <= limit`), so a refused request is not counted
//! (the reference counts it: its counter can pass the limit, which only makes both services
//! refuse sooner). Both admit while the count after the hits is at most the limit, so a fleet
//! of both admits exactly the limit per window.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;
use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use tokio::sync::Mutex;
use tollgate::StoreError;

use crate::settings::{RedisKind, RedisTarget};

/// Adds `ARGV[1]` hits to the counter `KEYS[1]` when the count stays within `ARGV[2]`, and
/// (re)sets its expiry to `ARGV[3]` seconds; returns `{admitted, count}` (the count after an
/// admission, before a refusal).
const CHARGE: &str = r"
local hits = tonumber(ARGV[1])
local used = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if used + hits > tonumber(ARGV[2]) then
  return {0, used}
end
if hits > 0 then
  used = redis.call('INCRBY', KEYS[1], hits)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, used}
";

/// Takes `ARGV[1]` hits off the counter `KEYS[1]`, never below 0, keeping its expiry; returns
/// the count.
const REFUND: &str = r"
local used = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if used <= 0 then
  return 0
end
return redis.call('DECRBY', KEYS[1], math.min(used, tonumber(ARGV[1])))
";

enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Box<Sentinel>),
}

struct Sentinel {
    client: Mutex<SentinelClient>,
    conn: Mutex<Option<MultiplexedConnection>>,
}

/// A connection to the Redis of the reference's counters.
pub(crate) struct Client {
    conn: Conn,
    timeout: Duration,
    prefix: Arc<str>,
    jitter_max: u64,
    charge: Script,
    refund: Script,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("compat::Client").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

fn failed(e: &redis::RedisError) -> StoreError {
    StoreError::backend(e.to_string())
}

impl Client {
    /// Connects to `target`.
    pub(crate) async fn connect(
        target: &RedisTarget,
        timeout: Duration,
        prefix: &str,
        jitter_max: u64,
    ) -> Result<Self, StoreError> {
        let conn = match &target.kind {
            RedisKind::Single => {
                let client =
                    redis::Client::open(target.nodes[0].as_str()).map_err(|e| failed(&e))?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout.max(Duration::from_secs(1)));
                Conn::Single(
                    ConnectionManager::new_with_config(client, config)
                        .await
                        .map_err(|e| failed(&e))?,
                )
            }
            RedisKind::Cluster => {
                let client = redis::cluster::ClusterClient::new(target.nodes.clone())
                    .map_err(|e| failed(&e))?;
                Conn::Cluster(client.get_async_connection().await.map_err(|e| failed(&e))?)
            }
            RedisKind::Sentinel { master, node } => {
                let info = match node {
                    Some(url) => {
                        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                            .map_err(|e| failed(&e))?;
                        Some(SentinelNodeConnectionInfo {
                            tls_mode: None,
                            redis_connection_info: Some(info.redis),
                        })
                    }
                    None => None,
                };
                let client = SentinelClient::build(
                    target.nodes.clone(),
                    master.clone(),
                    info,
                    SentinelServerType::Master,
                )
                .map_err(|e| failed(&e))?;
                Conn::Sentinel(Box::new(Sentinel {
                    client: Mutex::new(client),
                    conn: Mutex::new(None),
                }))
            }
        };
        Ok(Self {
            conn,
            timeout,
            prefix: Arc::from(prefix),
            jitter_max,
            charge: Script::new(CHARGE),
            refund: Script::new(REFUND),
        })
    }

    /// The counter's key for `base` (`<domain>_<key>_<value>_..._`) in the window holding
    /// `now` (Unix seconds) of `unit_secs`.
    pub(crate) fn key(&self, base: &str, now: u64, unit_secs: u64) -> String {
        window_key(&self.prefix, base, now, unit_secs)
    }

    /// Charges `hits` to `key` if the count stays within `limit`; `(admitted, count)`.
    pub(crate) async fn charge(
        &self,
        key: &str,
        hits: u64,
        limit: u64,
        unit_secs: u64,
    ) -> Result<(bool, u64), StoreError> {
        let jitter = if self.jitter_max > 0 { fastrand::u64(0..self.jitter_max) } else { 0 };
        let mut inv = self.charge.key(key);
        inv.arg(hits).arg(limit).arg(unit_secs + jitter);
        let (admitted, used): (u8, u64) = self.run(&inv).await?;
        Ok((admitted == 1, used))
    }

    /// Takes `hits` off `key` (never below 0).
    pub(crate) async fn refund(&self, key: &str, hits: u64) -> Result<u64, StoreError> {
        let mut inv = self.refund.key(key);
        inv.arg(hits);
        self.run(&inv).await
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let call = async {
            match &self.conn {
                Conn::Single(c) => invoke(inv, &mut c.clone()).await,
                Conn::Cluster(c) => invoke(inv, &mut c.clone()).await,
                Conn::Sentinel(s) => {
                    let mut conn = {
                        let mut held = s.conn.lock().await;
                        match &*held {
                            Some(c) => c.clone(),
                            None => {
                                let c = s.client.lock().await.get_async_connection().await?;
                                *held = Some(c.clone());
                                c
                            }
                        }
                    };
                    let result = invoke(inv, &mut conn).await;
                    if result.as_ref().is_err_and(|e| {
                        e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
                    }) {
                        // The master may have moved: ask the sentinels again next time.
                        *s.conn.lock().await = None;
                    }
                    result
                }
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(failed(&e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}

async fn invoke<C: ConnectionLike + Send, T: redis::FromRedisValue>(
    inv: &redis::ScriptInvocation<'_>,
    conn: &mut C,
) -> redis::RedisResult<T> {
    inv.invoke_async(conn).await
}

/// `<prefix><base><window start>`, as the reference's cache key generator writes it.
pub(crate) fn window_key(prefix: &str, base: &str, now: u64, unit_secs: u64) -> String {
    let start = now / unit_secs * unit_secs;
    let mut key = String::with_capacity(prefix.len() + base.len() + 11);
    key.push_str(prefix);
    key.push_str(base);
    key.push_str(itoa::Buffer::new().format(start));
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_keys_are_the_references() {
        // domain "rl", descriptor [(generic_key, slow)], unit minute, at 1_700_000_123 s.
        assert_eq!(
            window_key("", "rl_generic_key_slow_", 1_700_000_123, 60),
            "rl_generic_key_slow_1700000100"
        );
        assert_eq!(window_key("pfx_", "rl_a_b_c__", 59, 60), "pfx_rl_a_b_c__0");
        // A month is 30 days from the epoch.
        assert_eq!(window_key("", "d_k_v_", 2_592_000 * 3 + 5, 2_592_000), "d_k_v_7776000");
    }
}
