//! Lease mode fleets on one redis-server and one fake clock: leasing instances and an exact
//! one sharing a key's budget, and the checks they make together.

use std::time::Duration;

use tollgate::clock::{Clock, FakeClock};
use tollgate::key::Key;
use tollgate::store::{Check, Lease, RedisPolicy, RedisStore, Store};
use tollgate::{Algorithm, Decision, Policy, Quota, Source};

use super::redis::{Cluster, Server};
use super::stores::redis::on_clock;

/// A second, in nanoseconds.
const S: u64 = 1_000_000_000;

/// A throw-away redis-server and a fake clock at 1,000 s, where the lease tests start; `None`
/// when redis-server is not installed (the test then passes without running).
pub fn started() -> Option<(Server, FakeClock)> {
    let server = Server::start("redis-server")?;
    let clock = FakeClock::new();
    clock.set(1_000 * S);
    Some((server, clock))
}

/// A policy `name` of one fixed-window tier `tier` of `quota`.
pub fn fixed_window(name: &str, tier: &str, quota: Quota) -> Policy {
    Policy::builder(name).algorithm(Algorithm::FixedWindow).tier(tier, quota).build().unwrap()
}

/// Instances leasing the hot key.
pub const N: usize = 4;

/// `N` leasing instances of `policy` and one exact instance, sharing one budget.
pub fn fleet(
    url: &str,
    clock: &FakeClock,
    policy: &Policy,
    lease: Lease,
) -> (Vec<(RedisStore, RedisPolicy)>, (RedisStore, RedisPolicy)) {
    fleet_of(N, url, clock, policy, lease)
}

/// [`fleet`] of `n` leasing instances.
pub fn fleet_of(
    n: usize,
    url: &str,
    clock: &FakeClock,
    policy: &Policy,
    lease: Lease,
) -> (Vec<(RedisStore, RedisPolicy)>, (RedisStore, RedisPolicy)) {
    let prefix = format!("lease{}:", fastrand::u32(..));
    let leasing = (0..n)
        .map(|_| {
            let s = on_clock(
                RedisStore::builder(url).lease_policy(policy.name(), lease),
                clock,
                &prefix,
            );
            let b = s.bind(policy).unwrap();
            assert_eq!(b.lease(), Some(lease));
            (s, b)
        })
        .collect();
    let s = on_clock(RedisStore::builder(url), clock, &prefix);
    let b = s.bind(policy).unwrap();
    assert_eq!(b.lease(), None);
    (leasing, (s, b))
}

pub async fn check(node: &(RedisStore, RedisPolicy), key: &Key, cost: u64) -> Decision {
    node.0.check(&node.1, Check::new(key, cost)).await.expect("redis answers").decision
}

/// What the key has left in Redis, by a query of the exact instance.
pub async fn left(exact: &(RedisStore, RedisPolicy), key: &Key) -> u64 {
    check(exact, key, 0).await.tiers()[0].remaining()
}

/// Runs the fleet for `steps` ms of fake time, every node checking concurrently within a
/// step; returns the admission instants (ns) of each node.
pub async fn hammer(
    nodes: &[(RedisStore, RedisPolicy)],
    clock: &FakeClock,
    key: &Key,
    steps: u64,
    demands: fn(usize, u64) -> bool,
) -> Vec<u64> {
    let mut admitted = Vec::new();
    for step in 0..steps {
        let now = clock.now();
        let asks = (0..N).filter(|&i| demands(i, step)).map(|i| check(&nodes[i], key, 1));
        let decided = futures_join(asks).await;
        for d in decided {
            if d.is_allowed() {
                assert_eq!(d.source(), Source::Store);
                admitted.push(now);
            }
        }
        clock.advance(Duration::from_millis(1));
    }
    admitted
}

/// Awaits every future, polled together (so the nodes' calls overlap).
pub async fn futures_join<F: std::future::Future>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in set.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}

pub fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Two instances leasing `policy` on `cluster`, on one fake clock.
pub fn on_cluster(
    cluster: &Cluster,
    policy: &Policy,
    lease: Lease,
) -> Vec<(RedisStore, RedisPolicy)> {
    let clock = FakeClock::new();
    clock.set(1_000 * S);
    let prefix = format!("cluster{}:", fastrand::u32(..));
    (0..2)
        .map(|_| {
            let builder =
                RedisStore::cluster_builder(cluster.urls()).lease_policy(policy.name(), lease);
            let s = on_clock(builder, &clock, &prefix);
            let b = s.bind(policy).unwrap();
            (s, b)
        })
        .collect()
}

/// `rounds` rounds of every node asking for a unit of each of 6 keys, concurrently: the units
/// admitted per key.
pub async fn asked_on_cluster(nodes: &[(RedisStore, RedisPolicy)], rounds: usize) -> Vec<u64> {
    let keys: Vec<Key> = (0..6).map(|i| Key::text(format!("k{i}"))).collect();
    let mut admitted = vec![0u64; keys.len()];
    for _ in 0..rounds {
        let asks = keys.iter().flat_map(|k| nodes.iter().map(move |n| check(n, k, 1)));
        let decided = futures_join(asks).await;
        for (i, d) in decided.iter().enumerate() {
            admitted[i / nodes.len()] += u64::from(d.is_allowed());
        }
    }
    admitted
}
