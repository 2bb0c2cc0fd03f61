//! Throw-away Redis servers for tests: each on a free 127.0.0.1 port with `--save ""` and its
//! own temp dir, killed (and the dir removed) on drop. Never port 6379, never off loopback.
//! Standalone servers, a three-master Redis Cluster, and a master with a replica watched by
//! three sentinels ([`Sentinels`]).
//!
//! When the server binary is missing the test is skipped with a note on stderr, except under
//! `CI=true`, where that is a failure (`.ci/run` installs it) — for `valkey-server` only when
//! `.ci/run` could install it (else it sets `TOLLGATE_VALKEY_OPTIONAL=1` and the Valkey tests
//! report that they were skipped, and why).

use std::collections::HashMap;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// Whether `bin` can be run; panics under `CI=true` when it cannot.
pub fn available(bin: &str) -> bool {
    let found = Command::new(bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return true;
    }
    // Valkey may be optional in CI: `.ci/run` says so when this system offers no package.
    let optional =
        bin == "valkey-server" && std::env::var("TOLLGATE_VALKEY_OPTIONAL").is_ok_and(|v| v == "1");
    assert!(
        optional || std::env::var("CI").map_or(true, |v| v != "true"),
        "`{bin}` is not installed, and CI=true requires the Redis tests to run \
         (.ci/run installs it with apt-get)"
    );
    // Straight to stderr: the test harness captures print macros, not this. The harness names
    // each test's thread after the test.
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let why =
        if optional { " (TOLLGATE_VALKEY_OPTIONAL=1: .ci/run could not install it)" } else { "" };
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: `{bin}` is not on PATH{why}; install it (apt-get install redis-server / \
         valkey-server) to run it; it passes without having run"
    );
    false
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    l.local_addr().expect("local addr").port()
}

/// What a server process is.
#[derive(Debug, Clone)]
enum Role {
    Standalone,
    ClusterNode,
    /// A replica of the server on this loopback port.
    ReplicaOf(u16),
    /// A sentinel watching the master on this loopback port under this name.
    Sentinel {
        name: String,
        master: u16,
    },
}

/// One server process.
pub struct Server {
    bin: String,
    pub port: u16,
    role: Role,
    cluster_port: Option<u16>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Starts `bin` (`redis-server` or `valkey-server`), or `None` when it is not installed.
    pub fn start(bin: &str) -> Option<Self> {
        available(bin).then(|| Self::start_with(bin, Role::Standalone))
    }

    fn start_with(bin: &str, role: Role) -> Self {
        let mut last = String::new();
        for _ in 0..5 {
            let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("tollgate-test-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create temp dir");
            let mut s = Self {
                bin: bin.to_owned(),
                port: free_port(),
                cluster_port: matches!(role, Role::ClusterNode).then(free_port),
                role: role.clone(),
                dir,
                child: None,
            };
            match s.spawn() {
                Ok(()) => return s,
                Err(e) => last = e, // most likely a port taken between probe and bind: retry
            }
        }
        panic!("could not start {bin}: {last}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        assert_ne!(self.port, 6379, "never the default Redis port");
        let mut cmd = Command::new(&self.bin);
        if let Role::Sentinel { name, master } = &self.role {
            // A sentinel runs from a config file of its own, which it rewrites.
            let conf = self.dir.join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
                 sentinel monitor {name} 127.0.0.1 {master} 2\n\
                 sentinel down-after-milliseconds {name} 500\n\
                 sentinel failover-timeout {name} 2000\n",
                port = self.port,
                dir = self.dir.display(),
                log = self.dir.join("server.log").display(),
            );
            std::fs::write(&conf, text).map_err(|e| format!("write {conf:?}: {e}"))?;
            cmd.arg(&conf).arg("--sentinel");
        } else {
            cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(&self.dir)
                .arg("--logfile")
                .arg(self.dir.join("server.log"));
        }
        if let Role::ReplicaOf(master) = self.role {
            cmd.args(["--replicaof", "127.0.0.1", &master.to_string()]);
        }
        if let Some(bus) = self.cluster_port {
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(self.dir.join("nodes.conf"))
                .args(["--cluster-port", &bus.to_string(), "--cluster-node-timeout", "2000"]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.bin))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Err(format!("{} exited with {status}; log:\n{}", self.bin, self.log()));
            }
            if self.ping() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Err(format!("{} did not answer PING within 10 s; log:\n{}", self.bin, self.log()))
    }

    /// `127.0.0.1:{port}`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:{port}/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A `RedisStore` on this server, its keys under `prefix`, with a timeout of 5 s (a
    /// loaded test machine is slow, never the loopback).
    pub fn store(&self, prefix: &str) -> tollgate::store::RedisStore {
        tollgate::store::RedisStore::builder(self.url())
            .prefix(prefix)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_else(|e| panic!("a store on the test server: {e}"))
    }

    /// The server's log, for panic messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else { return false };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut conn).is_ok_and(|p| p == "PONG")
    }

    /// A synchronous connection for inspecting the server (`PTTL`, `KEYS`, ...).
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .unwrap_or_else(|e| panic!("connect to the test server: {e}; log:\n{}", self.log()))
    }

    /// Kills the server (SIGKILL): connections drop, state is lost.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap_or_else(|e| panic!("restart: {e}"));
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("server running").id();
        let ok =
            Command::new("kill").args([sig, &pid.to_string()]).status().is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }

    /// Freezes the server (SIGSTOP): connections stay open, calls hang.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A paused server must be thawed to die cleanly under SIGKILL on some kernels.
            let _ = Command::new("kill").args(["-CONT", &child.id().to_string()]).status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of three masters, no replicas, formed with `redis-cli --cluster create`.
pub struct Cluster {
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// Starts and joins three `redis-server`s, or `None` when Redis is not installed.
    pub fn start() -> Option<Self> {
        if !available("redis-server") || !available("redis-cli") {
            return None;
        }
        let nodes: Vec<Server> =
            (0..3).map(|_| Server::start_with("redis-server", Role::ClusterNode)).collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_ok();
        Some(cluster)
    }

    /// Waits (up to 20 s) until every node reports `cluster_state:ok` with all slots assigned.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.is_ok() {
            assert!(Instant::now() < deadline, "cluster did not reach cluster_state:ok in 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_ok(&self) -> bool {
        self.nodes.iter().all(|n| {
            let info: String =
                redis::cmd("CLUSTER").arg("INFO").query(&mut n.conn()).unwrap_or_default();
            info.contains("cluster_state:ok") && info.contains("cluster_slots_assigned:16384")
        })
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::url).collect()
    }

    /// The node serving `key`'s slot (the others answer `MOVED`).
    pub fn node_of(&self, key: &str) -> &Server {
        self.nodes
            .iter()
            .find(|n| redis::cmd("EXISTS").arg(key).query::<i64>(&mut n.conn()).is_ok())
            .expect("some node serves the slot")
    }
}

/// A Redis master, one replica of it (`--replicaof`), and three sentinels watching it (quorum
/// 2, `down-after-milliseconds` 500, `failover-timeout` 2000), each sentinel with its own
/// config file in its own temp dir.
pub struct Sentinels {
    pub master: Server,
    pub replica: Server,
    pub sentinels: Vec<Server>,
    /// The name the sentinels know the master by.
    pub name: String,
}

impl Sentinels {
    /// Starts them and waits (up to 20 s) until the replica is in sync and every sentinel
    /// knows the replica and the two other sentinels (so that a failover can happen), or
    /// `None` when Redis is not installed.
    pub fn start() -> Option<Self> {
        if !available("redis-server") {
            return None;
        }
        let name = "tollgate-test".to_owned();
        let master = Server::start_with("redis-server", Role::Standalone);
        let replica = Server::start_with("redis-server", Role::ReplicaOf(master.port));
        let sentinels = (0..3)
            .map(|_| {
                let role = Role::Sentinel { name: name.clone(), master: master.port };
                Server::start_with("redis-server", role)
            })
            .collect();
        let group = Self { master, replica, sentinels, name };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !group.ready() {
            assert!(
                Instant::now() < deadline,
                "sentinels not ready in 20 s; sentinel log:\n{}",
                group.sentinels[0].log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(group)
    }

    fn ready(&self) -> bool {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut self.replica.conn())
            .unwrap_or_default();
        info.contains("master_link_status:up")
            && self.sentinels.iter().all(|s| {
                let fields: HashMap<String, String> = redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(&self.name)
                    .query(&mut s.conn())
                    .unwrap_or_default();
                let field = |k: &str| fields.get(k).map_or("", String::as_str);
                field("flags") == "master"
                    && field("num-slaves") == "1"
                    && field("num-other-sentinels") == "2"
            })
    }

    /// The sentinels' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Server::url).collect()
    }

    /// The master's `host:port` as `sentinel` reports it (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub fn master_addr(&self, sentinel: usize) -> Option<String> {
        let reply: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.name)
            .query(&mut self.sentinels[sentinel].conn())
            .ok()?;
        reply.map(|(host, port)| format!("{host}:{port}"))
    }

    /// The sentinels' logs, for panic messages.
    pub fn logs(&self) -> String {
        self.sentinels.iter().map(|s| format!("--- sentinel {}\n{}", s.port, s.log())).collect()
    }
}
