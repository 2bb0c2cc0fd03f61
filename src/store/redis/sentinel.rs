//! Redis Sentinel: which server is the master now, asked of the sentinels with the `redis`
//! crate's sentinel support, so that the store follows a failover without a restart.
//!
//! Every server the sentinels name gets its own [`Node`] (connection, queue, circuit breaker,
//! health), kept by address, so a failed master's breaker stays open on its own node while
//! checks go to the promoted one, whose breaker starts closed. The sentinels are asked:
//!
//! - on first use (checks wait for the answer until their deadline);
//! - after a check on the master failed (its breaker open, no reply, a refused connection, or
//!   an error of the server's such as `READONLY` from a master demoted to a replica), at most
//!   every [`RETRY`]: during a failover they keep naming the failed master, flagged down, which
//!   the `redis` crate refuses, until they promote a replica;
//! - otherwise every [`REFRESH`], so that a master that was demoted while this process could
//!   still reach it (a partition between it and the sentinels) is left within about a second.
//!
//! One discovery runs at a time, on the store's thread ([`io`](super::io)), where the
//! sentinels' connections live. The sentinels are asked one after the other, starting with
//! the one that answered last, each within twice the store's timeout: one that is down or
//! frozen costs one such wait, not every discovery.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{ConnectionAddr, ConnectionInfo, TlsMode};
use tokio::sync::watch;
use tokio::time::Instant;

use super::addr_of;
use super::node::{Node, Settings};
use crate::error::StoreError;

/// While checks on the master fail, the sentinels are asked again at most this often.
pub(crate) const RETRY: Duration = Duration::from_millis(100);

/// While the master answers, the sentinels are asked again this often.
pub(crate) const REFRESH: Duration = Duration::from_secs(1);

/// How to connect to the servers the sentinels name, from `info` (its host and port unused).
pub(crate) fn servers(info: ConnectionInfo) -> SentinelNodeConnectionInfo {
    let tls_mode = match info.addr {
        ConnectionAddr::TcpTls { insecure: true, .. } => Some(TlsMode::Insecure),
        ConnectionAddr::TcpTls { insecure: false, .. } => Some(TlsMode::Secure),
        _ => None,
    };
    SentinelNodeConnectionInfo { tls_mode, redis_connection_info: Some(info.redis) }
}

/// A master known by its name to a set of sentinels.
pub(crate) struct Watched {
    name: Box<str>,
    /// One client per sentinel (each built from that sentinel alone), so that each is asked
    /// within its own time limit; each holds its connection to its sentinel.
    sentinels: Vec<(ConnectionInfo, tokio::sync::Mutex<Sentinel>)>,
    /// The sentinel that answered last, asked first.
    preferred: AtomicUsize,
    /// How to connect to the servers the sentinels name (TLS, user, password, database).
    servers: SentinelNodeConnectionInfo,
    settings: Arc<Settings>,
    /// The master the sentinels named last.
    master: RwLock<Option<Arc<Node>>>,
    /// Every server named so far, by `host:port`, with its breaker.
    nodes: RwLock<HashMap<String, Arc<Node>>>,
    asking: Mutex<Asking>,
    /// Counts finished discoveries: checks made before any master is known wait on it.
    asked: watch::Sender<u64>,
}

#[derive(Default)]
struct Asking {
    /// A discovery is running.
    running: bool,
    /// When the last one started.
    started: Option<Instant>,
    /// Why the last one failed.
    error: Option<String>,
}

impl Watched {
    /// The master named `name` by `sentinels`.
    ///
    /// # Errors
    /// The `redis` crate's, when it refuses a sentinel's address.
    pub(crate) fn new(
        name: &str,
        sentinels: Vec<ConnectionInfo>,
        servers: SentinelNodeConnectionInfo,
        settings: Arc<Settings>,
    ) -> redis::RedisResult<Self> {
        let sentinels = sentinels
            .into_iter()
            .map(|info| {
                let client = Sentinel::build(vec![info.clone()])?;
                Ok((info, tokio::sync::Mutex::new(client)))
            })
            .collect::<redis::RedisResult<_>>()?;
        Ok(Self {
            name: name.into(),
            sentinels,
            preferred: AtomicUsize::new(0),
            servers,
            settings,
            master: RwLock::new(None),
            nodes: RwLock::new(HashMap::new()),
            asking: Mutex::new(Asking::default()),
            asked: watch::Sender::new(0),
        })
    }

    /// The master the sentinels named last.
    pub(crate) fn current(&self) -> Option<Arc<Node>> {
        self.master.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Every server named so far.
    pub(crate) fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.read().unwrap_or_else(PoisonError::into_inner).values().cloned().collect()
    }

    /// The master's node: the server the sentinels named last (asking them again in the
    /// background when that was [`REFRESH`] ago), or, before they named any, the one they name
    /// now, waited for until `deadline`.
    ///
    /// # Errors
    /// [`StoreError::Timeout`] (the store's timeout) when no sentinel answered by `deadline`;
    /// [`StoreError::Backend`] with each sentinel's answer when none named a master (none
    /// answered, none knows `name`, or the server named is down or not a master).
    pub(crate) async fn master(
        self: &Arc<Self>,
        deadline: Instant,
    ) -> Result<Arc<Node>, StoreError> {
        if let Some(node) = self.current() {
            self.ask(REFRESH);
            return Ok(node);
        }
        let mut asked = self.asked.subscribe();
        asked.borrow_and_update();
        loop {
            if let Some(node) = self.current() {
                return Ok(node);
            }
            if !self.ask(RETRY) {
                return Err(self.error());
            }
            match tokio::time::timeout_at(deadline, asked.changed()).await {
                Ok(Ok(())) => {
                    asked.borrow_and_update();
                }
                Ok(Err(_)) => return Err(self.error()),
                Err(_) => return Err(StoreError::Timeout(self.settings.timeout)),
            }
        }
    }

    /// A check on the master failed: asks the sentinels again, at most every [`RETRY`].
    pub(crate) fn suspect(self: &Arc<Self>) {
        self.ask(RETRY);
    }

    fn error(&self) -> StoreError {
        let asking = self.asking.lock().unwrap_or_else(PoisonError::into_inner);
        let why = asking.error.as_deref().unwrap_or("the sentinels named no master yet");
        StoreError::backend(format!("redis sentinel, master {:?}: {why}", self.name))
    }

    /// Starts asking the sentinels on the store's thread, unless they are being asked or were
    /// asked less than `gap` ago. Whether a discovery is running now.
    fn ask(self: &Arc<Self>, gap: Duration) -> bool {
        let now = Instant::now();
        {
            let mut asking = self.asking.lock().unwrap_or_else(PoisonError::into_inner);
            if asking.running {
                return true;
            }
            if asking.started.is_some_and(|at| now.saturating_duration_since(at) < gap) {
                return false;
            }
            asking.running = true;
            asking.started = Some(now);
        }
        let handle = match self.settings.io.handle() {
            Ok(handle) => handle,
            Err(error) => {
                self.finish(Err(error.to_string()));
                return false;
            }
        };
        // Weak: a discovery does not keep a dropped store's thread alive.
        let this = Arc::downgrade(self);
        handle.spawn(async move {
            let Some(this) = this.upgrade() else { return };
            let found = this.discover().await;
            this.finish(found);
        });
        true
    }

    /// Asks each sentinel in turn, from the preferred one, for the master, and follows the
    /// first answer.
    async fn discover(&self) -> Result<(), String> {
        let n = self.sentinels.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let limit = self.settings.call_timeout();
        let mut errors = Vec::with_capacity(n);
        for i in (0..n).map(|i| (first + i) % n) {
            let (info, sentinel) = &self.sentinels[i];
            let mut sentinel = sentinel.lock().await;
            let asked = sentinel.async_master_for(&self.name, Some(&self.servers));
            match tokio::time::timeout(limit, asked).await {
                Ok(Ok(client)) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    self.follow(client);
                    return Ok(());
                }
                Ok(Err(e)) => errors.push(format!("{}: {e}", addr_of(info))),
                Err(_) => {
                    // Its connection may be stuck (a frozen sentinel): start afresh next time.
                    if let Ok(fresh) = Sentinel::build(vec![info.clone()]) {
                        *sentinel = fresh;
                    }
                    errors.push(format!("{}: no answer within {limit:?}", addr_of(info)));
                }
            }
        }
        Err(errors.join("; "))
    }

    /// Makes the server of `client` the master.
    fn follow(&self, client: redis::Client) {
        let addr = addr_of(client.get_connection_info());
        let node = {
            let mut nodes = self.nodes.write().unwrap_or_else(PoisonError::into_inner);
            let node = nodes.entry(addr.clone()).or_insert_with(|| {
                Arc::new(Node::new(addr.as_str().into(), client, Arc::clone(&self.settings)))
            });
            Arc::clone(node)
        };
        let mut master = self.master.write().unwrap_or_else(PoisonError::into_inner);
        match master.as_ref() {
            Some(old) if Arc::ptr_eq(old, &node) => {}
            Some(old) => {
                tracing::warn!(master = %self.name, from = %old.addr, to = %addr, "tollgate: redis sentinel named a new master; checks go there");
                *master = Some(node);
            }
            None => {
                tracing::info!(master = %self.name, node = %addr, "tollgate: redis sentinel named the master");
                *master = Some(node);
            }
        }
    }

    fn finish(&self, found: Result<(), String>) {
        if let Err(why) = &found {
            tracing::debug!(master = %self.name, %why, "tollgate: no redis sentinel named a master");
        }
        {
            let mut asking = self.asking.lock().unwrap_or_else(PoisonError::into_inner);
            asking.running = false;
            asking.error = found.err();
        }
        self.asked.send_modify(|n| *n = n.wrapping_add(1));
    }
}

#[cfg(test)]
mod tests {
    use redis::IntoConnectionInfo;

    use super::*;

    #[test]
    fn the_master_url_gives_the_servers_user_password_and_database() {
        let info = "redis://user:pass@master:1234/3".into_connection_info().unwrap();
        let servers = servers(info);
        assert!(servers.tls_mode.is_none());
        let redis = servers.redis_connection_info.unwrap();
        assert_eq!(
            (redis.db, redis.username.as_deref(), redis.password.as_deref()),
            (3, Some("user"), Some("pass"))
        );
    }
}
