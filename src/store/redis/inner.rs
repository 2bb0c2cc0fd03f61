//! The store at work: its clock, the Cluster's slot map and nodes, script calls routed and
//! submitted, and the local fallback when Redis cannot decide.

use super::*;

impl Inner {
    /// Once, at the first check: logs (and counts) each name given to
    /// [`RedisStoreBuilder::lease_policy`] that no policy bound to the store by then uses.
    #[cold]
    pub(super) fn check_lease_names(&self) {
        use std::sync::atomic::Ordering;
        if self.lease_names_checked.swap(true, Ordering::AcqRel) {
            return;
        }
        let bound = self.bound_names.lock().unwrap_or_else(PoisonError::into_inner);
        let mut unknown: Vec<&String> =
            self.lease_policies.keys().filter(|n| !bound.contains(*n)).collect();
        unknown.sort();
        for name in unknown {
            tracing::warn!(
                setting = "lease_policy",
                policy = %name,
                bound = ?*bound,
                "tollgate: lease_policy names a policy that no policy bound to this store uses: \
                 nothing leases under that name"
            );
            crate::metrics::config_warning(name, "lease_policy");
        }
    }

    /// The instant `prepared`'s records make their calendar bounds at: [`app_now`](Self::app_now)
    /// for a policy with calendar tiers; the others send no bounds, and read no clock.
    pub(super) fn bounds_now(&self, prepared: &Prepared) -> u64 {
        if prepared.has_calendars() { self.app_now() } else { 0 }
    }

    /// This process's idea of now: the injected clock's, or the system's (nanoseconds since
    /// the Unix epoch). Only calendar tiers need it, for the windows a check sends.
    pub(super) fn app_now(&self) -> u64 {
        let system = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, duration_to_nanos)
        };
        self.settings.clock.as_ref().map_or_else(system, AnyClock::now)
    }

    /// The cluster's slot map, read with `CLUSTER SLOTS` from the first node that answers.
    pub(super) async fn slot_map(&self, cluster: &Cluster) -> Result<Arc<SlotMap>, StoreError> {
        if let Some(map) = cluster.map.read().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(map);
        }
        let _refreshing = cluster.refreshing.lock().await;
        if let Some(map) = cluster.map.read().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(map);
        }
        let known: Vec<Arc<Node>> = cluster
            .nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|n| n.breaker_state() == BreakerState::Closed)
            .cloned()
            .collect();
        let mut last = StoreError::backend("no Redis Cluster node answered CLUSTER SLOTS");
        let seeds = cluster.seeds.iter().map(|info| self.node_for(info.clone()));
        for node in known.into_iter().chain(seeds) {
            let ask = node.on_io(|node| async move {
                let mut conn = node.connection().await?;
                redis::cmd("CLUSTER").arg("SLOTS").query_async::<redis::Value>(&mut conn).await
            });
            match tokio::time::timeout(self.settings.timeout, ask).await {
                Ok(Err(e)) => last = e,
                Ok(Ok(Err(e))) => last = StoreError::backend(e),
                Ok(Ok(Ok(reply))) => {
                    if let Some(map) = SlotMap::parse(&reply) {
                        let map = Arc::new(map);
                        *cluster.map.write().unwrap_or_else(PoisonError::into_inner) =
                            Some(Arc::clone(&map));
                        return Ok(map);
                    }
                    last = StoreError::backend("unexpected CLUSTER SLOTS reply");
                }
                Err(_) => last = StoreError::Timeout(self.settings.timeout),
            }
        }
        Err(last)
    }

    /// A node for a connection (not registered).
    pub(super) fn node_for(&self, info: ConnectionInfo) -> Arc<Node> {
        let addr: Arc<str> = addr_of(&info).into();
        let client = redis::Client::open(info).unwrap_or_else(|_| unreachable_client());
        Arc::new(Node::new(addr, client, Arc::clone(&self.settings)))
    }

    /// The registered node of master `addr` (`host:port`), made from the first seed's settings.
    pub(super) fn cluster_node(
        &self,
        cluster: &Cluster,
        addr: &str,
    ) -> Result<Arc<Node>, StoreError> {
        if let Some(node) = cluster.nodes.read().unwrap_or_else(PoisonError::into_inner).get(addr) {
            return Ok(Arc::clone(node));
        }
        let mut nodes = cluster.nodes.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = nodes.get(addr) {
            return Ok(Arc::clone(node));
        }
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| StoreError::backend(format!("bad node address {addr:?}")))?;
        let mut info =
            cluster.seeds.first().cloned().ok_or_else(|| StoreError::backend("no seed"))?;
        info.addr = match info.addr {
            ConnectionAddr::TcpTls { insecure, tls_params, .. } => {
                ConnectionAddr::TcpTls { host, port, insecure, tls_params }
            }
            _ => ConnectionAddr::Tcp(host, port),
        };
        let node = self.node_for(info);
        nodes.insert(addr.to_owned(), Arc::clone(&node));
        Ok(node)
    }

    /// Sends `blob` (a check or settlement on `keys`) to the node of its key and awaits its
    /// part of the reply and the instant decided at. Its deadline is now plus the store's
    /// timeout: finding the node must fit in it; past it, the check waits only as long as the
    /// server keeps up, and at most ten timeouts (`health.rs`).
    ///
    /// # Errors
    /// [`StoreError::Timeout`] when the check gives up (a call answered later may still have
    /// charged it in Redis); the call's error otherwise.
    pub(super) async fn submit_once(
        &self,
        prepared: &Prepared,
        keys: Vec<String>,
        record: Vec<f64>,
        reply_len: usize,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        let timeout = self.settings.timeout;
        let deadline = health::later(tokio::time::Instant::now(), timeout);
        let (node, slot) = match &self.topology {
            Topology::Single(node) => (Arc::clone(node), 0),
            Topology::Sentinel(watched) => (watched.master(deadline).await?, 0),
            Topology::Cluster(cluster) => {
                let slot = cluster::slot(&keys[0]);
                let map = tokio::time::timeout_at(deadline, self.slot_map(cluster))
                    .await
                    .unwrap_or(Err(StoreError::Timeout(timeout)))?;
                let addr = map
                    .node_of(slot)
                    .ok_or_else(|| StoreError::backend(format!("slot {slot} is not served")))?;
                (self.cluster_node(cluster, addr)?, slot)
            }
        };
        let (tx, rx) = oneshot::channel();
        let policy = Arc::clone(&prepared.policy);
        node.submit(Item {
            family: prepared.family,
            plain: !prepared.is_kinds(),
            slot,
            keys,
            policy,
            record,
            reply_len,
            deadline,
            at: self.settings.clock.as_ref().map(AnyClock::now),
            answer: tx,
        });
        let answer = node.wait(deadline, rx).await;
        if let (Err(_), Topology::Sentinel(watched)) = (&answer, &self.topology) {
            // The master may have failed, or been demoted (`READONLY`): ask the sentinels.
            watched.suspect();
        }
        if let (Err(StoreError::Backend(e)), Topology::Cluster(cluster)) = (&answer, &self.topology)
        {
            // A redirection: the slots moved. Read them again for the next call.
            let text = e.to_string();
            if text.contains("MOVED") || text.contains("ASK") || text.contains("CLUSTERDOWN") {
                cluster.map.write().unwrap_or_else(PoisonError::into_inner).take();
            }
        }
        answer
    }

    /// Decides on the local fallback after `error`, or returns `error` without one.
    pub(super) fn fall_back(
        &self,
        error: StoreError,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let (Some(local), Some(local_bound)) = (&self.fallback, &bound.local) else {
            return Err(error);
        };
        tracing::debug!(%error, policy = bound.policy.name(), "tollgate: redis unavailable; decided by the local fallback");
        let verdict = local.check_now(local_bound, check);
        let mut decision = verdict.decision;
        decision.source = Source::Fallback;
        Ok(Verdict { decision, ticket: verdict.ticket.map(|t| RedisTicket(Charged::Local(t))) })
    }
}

/// `redis::Client::open` cannot fail for a `ConnectionInfo` (it only parses URLs); this
/// client, on a closed port of loopback, is never made.
#[cold]
pub(super) fn unreachable_client() -> redis::Client {
    redis::Client::open(("127.0.0.1", 1)).unwrap_or_else(|_| unreachable_client())
}
