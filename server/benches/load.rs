//! A load generator for Envoy rate limit services: tollgate-server beside Kuadrant's
//! limitador-server (built from its source elsewhere; pass its binary with `--limitador`),
//! on the memory store and on Redis, with descriptors of 1 and 3 entries over 1 or 100,000
//! keys.
//!
//! For each case and run, each server is started as a child process on a loopback port and
//! called through tonic with many concurrent calls over several HTTP/2 connections:
//!
//! 1. **peak**: a closed loop of `--concurrency` calls for `--secs`: decisions per second, and
//!    decisions per CPU-second of the server (its user + system time from `/proc`);
//! 2. **half**: an open loop at half of that peak rate for `--secs`: p50 and p99 latency,
//!    each call timed from its scheduled instant (no coordinated omission), the calls paced by
//!    a thread of their own (Tokio's millisecond timer would add up to a millisecond). The
//!    generator's lag (from a call's scheduled instant until its task runs, before anything
//!    is sent) is reported beside: when its p99 nears the latency's, the generator, not the
//!    server, made the tail.
//!
//! Runs are interleaved (every server once per run); the report gives medians and ranges.
//!
//! The generator runs on the same machine, and a tonic client spends more CPU per call than
//! the servers do: on a small machine it is what limits the peak, and what it and other
//! processes take from the server's CPU shows in the latency. `--pin` keeps the generator
//! off CPU 1 and runs the server (and its Redis) on CPU 1 alone, with `taskset`, so that
//! the two do not take turns on one CPU; `--servers tollgate@<path>` runs another build of
//! tollgate-server beside this one, to compare two builds.
//!
//! ```text
//! cargo bench -p tollgate-server --bench load -- --limitador /work/peers/limitador/target/release/limitador-server
//!     [--servers tollgate,limitador] [--stores memory,redis] [--entries 1,3] [--keys 1,100000]
//!     [--runs 3] [--secs 5] [--concurrency 64] [--connections 4] [--pin]
//! ```

use std::collections::HashMap;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_server::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate_server::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate_server::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::{Channel, Endpoint};

struct Options {
    servers: Vec<String>,
    stores: Vec<String>,
    entries: Vec<usize>,
    keys: Vec<u64>,
    runs: usize,
    secs: f64,
    concurrency: usize,
    connections: usize,
    limitador: Option<PathBuf>,
    pin: bool,
}

fn options() -> Options {
    let mut o = Options {
        servers: vec!["tollgate".into(), "limitador".into()],
        stores: vec!["memory".into(), "redis".into()],
        entries: vec![1, 3],
        keys: vec![1, 100_000],
        runs: 3,
        secs: 5.0,
        concurrency: 64,
        connections: 4,
        limitador: None,
        pin: false,
    };
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        let list = |s: &str| s.split(',').map(str::to_owned).collect::<Vec<_>>();
        match args[i].as_str() {
            "--servers" => o.servers = list(&v),
            "--stores" => o.stores = list(&v),
            "--entries" => o.entries = list(&v).iter().map(|s| s.parse().unwrap()).collect(),
            "--keys" => o.keys = list(&v).iter().map(|s| s.parse().unwrap()).collect(),
            "--runs" => o.runs = v.parse().unwrap(),
            "--secs" => o.secs = v.parse().unwrap(),
            "--concurrency" => o.concurrency = v.parse().unwrap(),
            "--connections" => o.connections = v.parse().unwrap(),
            "--limitador" => o.limitador = Some(PathBuf::from(v)),
            "--pin" => {
                o.pin = true;
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    if o.limitador.is_none() {
        o.servers.retain(|s| s != "limitador");
    }
    o
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A throw-away redis-server on a free loopback port.
struct Redis {
    child: Child,
    port: u16,
    dir: PathBuf,
}

/// `program`, on the second CPU when `pin` (the service's side: the server and its Redis).
fn command(program: impl AsRef<std::ffi::OsStr>, pin: bool) -> Command {
    if pin {
        let mut c = Command::new("taskset");
        c.args(["-c", SERVICE_CPU]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// With `--pin`: the CPU of the servers and Redis; the generator keeps the others.
const SERVICE_CPU: &str = "1";

/// Keeps this process (the generator, all its threads) off [`SERVICE_CPU`].
fn pin_generator() {
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let others: Vec<String> =
        (0..cpus).map(|c| c.to_string()).filter(|c| c != SERVICE_CPU).collect();
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", &others.join(",")])
        .arg(std::process::id().to_string())
        .stdout(Stdio::null())
        .status()
        .expect("taskset");
    assert!(status.success(), "taskset could not pin the generator");
}

impl Redis {
    fn start(pin: bool) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tollgate-bench-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let child = command("redis-server", pin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server");
        let r = Self { child, port, dir };
        for _ in 0..200 {
            if r.cli(&["PING"]).trim() == "PONG" {
                return r;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not start");
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.child.id())
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// User + system time of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count from the closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the file are the 12th and 13th after the name.
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

fn ticks_per_second() -> f64 {
    let out = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(100.0)
}

const DOMAIN: &str = "bench";
/// Far above what a run can use: every call is a full decision, admitted.
const LIMIT: u64 = 1_000_000_000;

fn tollgate_config(entries: usize) -> String {
    let mut s = format!("domain: {DOMAIN}\ndescriptors:\n");
    let names = ["tenant", "route", "user"];
    let names = &names[3 - entries..];
    for (depth, name) in names.iter().enumerate() {
        let pad = "  ".repeat(depth * 2);
        s.push_str(&format!("{pad}  - key: {name}\n"));
        if depth + 1 == names.len() {
            s.push_str(&format!(
                "{pad}    rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}\n"
            ));
        } else {
            s.push_str(&format!("{pad}    descriptors:\n"));
        }
    }
    s
}

fn limitador_config(entries: usize) -> String {
    let names = ["tenant", "route", "user"];
    let vars: Vec<String> =
        names[3 - entries..].iter().map(|n| format!("      - descriptors[0].{n}\n")).collect();
    format!(
        "---\n- namespace: {DOMAIN}\n  max_value: {LIMIT}\n  seconds: 60\n  conditions: []\n  variables:\n{}",
        vars.concat()
    )
}

fn request(entries: usize, keys: u64) -> RateLimitRequest {
    let k = fastrand::u64(0..keys);
    let all = [
        ("tenant", format!("t{}", k % 100)),
        ("route", format!("/api/{}", k % 10)),
        ("user", format!("u{k}")),
    ];
    RateLimitRequest {
        domain: DOMAIN.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: all[3 - entries..]
                .iter()
                .map(|(key, v)| Entry { key: (*key).into(), value: v.clone() })
                .collect(),
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

struct Server {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(which: &str, o: &Options, store: &str, entries: usize, redis: Option<&Redis>) -> Server {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("tollgate-bench-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = match which {
        t if t == "tollgate" || t.starts_with("tollgate@") => {
            std::fs::write(dir.join("config.yaml"), tollgate_config(entries)).unwrap();
            // `tollgate@<path>`: another build of tollgate-server, to compare two builds.
            let binary =
                t.strip_prefix("tollgate@").unwrap_or(env!("CARGO_BIN_EXE_tollgate-server"));
            let mut c = command(binary, o.pin);
            c.args(["--config", dir.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")]);
            if store == "redis" {
                c.args(["--redis", &redis.unwrap().url()]);
            }
            c.env("LOG_LEVEL", "warn");
            c
        }
        "limitador" => {
            let limits = dir.join("limits.yaml");
            std::fs::write(&limits, limitador_config(entries)).unwrap();
            let mut c = command(o.limitador.as_ref().unwrap(), o.pin);
            c.arg(&limits).args([
                "--rls-ip",
                "127.0.0.1",
                "--rls-port",
                &port.to_string(),
                "--http-ip",
                "127.0.0.1",
                "--http-port",
                &free_port().to_string(),
            ]);
            if store == "redis" {
                c.args(["redis", &redis.unwrap().url()]);
            } else {
                c.arg("memory");
            }
            c
        }
        other => panic!("unknown server {other}"),
    };
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start the server");
    Server { child, port, dir }
}

async fn connect(port: u16, n: usize) -> Vec<RateLimitServiceClient<Channel>> {
    let mut clients = Vec::new();
    for _ in 0..n {
        for attempt in 0.. {
            match Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
                .unwrap()
                .tcp_nodelay(true)
                .connect()
                .await
            {
                Ok(ch) => {
                    clients.push(RateLimitServiceClient::new(ch));
                    break;
                }
                Err(e) if attempt > 250 => panic!("cannot connect: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
    clients
}

/// Closed loop: `concurrency` callers for `secs`; calls answered.
async fn peak(
    clients: &[RateLimitServiceClient<Channel>],
    concurrency: usize,
    secs: f64,
    entries: usize,
    keys: u64,
) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..concurrency {
        let mut c = clients[i % clients.len()].clone();
        let (done, stop) = (done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if c.should_rate_limit(request(entries, keys)).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let n = done.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    n
}

/// Open loop at `rate` calls a second for `secs`: each call's latency from its scheduled
/// instant, in microseconds.
async fn open_loop(
    clients: &[RateLimitServiceClient<Channel>],
    rate: f64,
    secs: f64,
    entries: usize,
    keys: u64,
) -> (Vec<u64>, Vec<u64>) {
    let n = (rate * secs) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let clients = clients.to_vec();
    let runtime = tokio::runtime::Handle::current();
    // The calls are paced by a thread of their own: Tokio's timer wakes on whole milliseconds,
    // which would send a call due sooner up to a millisecond late (counted as latency); a
    // thread's sleep wakes within tens of microseconds. Every call that is due is sent at each
    // wake-up, so a busy generator sends late rather than fewer (no coordinated omission).
    let tasks = tokio::task::spawn_blocking(move || {
        let start = Instant::now() + Duration::from_millis(10);
        let at = |i: u64| start + interval * u32::try_from(i).unwrap();
        let mut tasks = Vec::with_capacity(n as usize);
        let mut i = 0;
        while i < n {
            let now = Instant::now();
            while i < n && at(i) <= now {
                let scheduled = at(i);
                let mut c = clients[i as usize % clients.len()].clone();
                tasks.push(runtime.spawn(async move {
                    let lag = micros(scheduled.elapsed());
                    let ok = c.should_rate_limit(request(entries, keys)).await.is_ok();
                    ok.then(|| (micros(scheduled.elapsed()), lag))
                }));
                i += 1;
            }
            if i < n {
                std::thread::sleep(at(i).saturating_duration_since(Instant::now()));
            }
        }
        tasks
    })
    .await
    .unwrap();
    let mut lat = Vec::with_capacity(tasks.len());
    let mut lags = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(Some((l, lag))) = t.await {
            lat.push(l);
            lags.push(lag);
        }
    }
    lat.sort_unstable();
    lags.sort_unstable();
    (lat, lags)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

#[derive(Default, Clone)]
struct Sample {
    rate: f64,
    per_cpu: f64,
    server_cpu: f64,
    redis_cpu: f64,
    p50: f64,
    p99: f64,
    lag99: f64,
}

fn median_range(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let o = options();
    let tick = ticks_per_second();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    if o.pin {
        // After the runtime is built: `-a` moves its worker threads too.
        pin_generator();
    }
    let mut results: HashMap<(String, String, usize, u64), Vec<Sample>> = HashMap::new();
    let mut order = Vec::new();
    for run in 0..o.runs {
        for store in &o.stores {
            let redis = (store == "redis").then(|| Redis::start(o.pin));
            for &entries in &o.entries {
                for &keys in &o.keys {
                    for server in &o.servers {
                        if let Some(r) = &redis {
                            r.cli(&["FLUSHALL"]);
                        }
                        let s = start(server, &o, store, entries, redis.as_ref());
                        let sample = rt.block_on(async {
                            let clients = connect(s.port, o.connections).await;
                            // Warm up (and wait for the first answers).
                            peak(&clients, o.concurrency, 1.0, entries, keys).await;
                            let (c0, r0) = (
                                cpu_ticks(s.child.id()),
                                redis.as_ref().map_or(0, Redis::cpu_ticks),
                            );
                            let t0 = Instant::now();
                            let n = peak(&clients, o.concurrency, o.secs, entries, keys).await;
                            let wall = t0.elapsed().as_secs_f64();
                            let server_cpu = (cpu_ticks(s.child.id()) - c0) as f64 / tick;
                            let redis_cpu =
                                (redis.as_ref().map_or(0, Redis::cpu_ticks) - r0) as f64 / tick;
                            let rate = n as f64 / wall;
                            let (lat, lags) =
                                open_loop(&clients, rate / 2.0, o.secs, entries, keys).await;
                            Sample {
                                rate,
                                per_cpu: n as f64 / server_cpu.max(1.0 / tick),
                                server_cpu: server_cpu / wall,
                                redis_cpu: redis_cpu / wall,
                                p50: pct(&lat, 0.5),
                                p99: pct(&lat, 0.99),
                                lag99: pct(&lags, 0.99),
                            }
                        });
                        eprintln!(
                            "run {run} {store:6} entries={entries} keys={keys:6} {server:9}: {:>8.0}/s, {:>8.0} per server CPU-s (server {:.2} cores, redis {:.2}), half load p50 {:.0} us p99 {:.0} us (generator lag p99 {:.0} us)",
                            sample.rate,
                            sample.per_cpu,
                            sample.server_cpu,
                            sample.redis_cpu,
                            sample.p50,
                            sample.p99,
                            sample.lag99
                        );
                        let key = (store.clone(), server.clone(), entries, keys);
                        if !results.contains_key(&key) {
                            order.push(key.clone());
                        }
                        results.entry(key).or_default().push(sample);
                    }
                }
            }
        }
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "\n| store | entries | keys | server | decisions/s | per server CPU-s | server cores | redis cores | p50 at half (us) | p99 at half (us) | generator lag p99 (us) |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for key in &order {
        let v = &results[key];
        let f = |g: fn(&Sample) -> f64| {
            let mut x: Vec<f64> = v.iter().map(g).collect();
            let (m, lo, hi) = median_range(&mut x);
            format!("{m:.0} ({lo:.0}-{hi:.0})")
        };
        let g = |g: fn(&Sample) -> f64| {
            let mut x: Vec<f64> = v.iter().map(g).collect();
            let (m, lo, hi) = median_range(&mut x);
            format!("{m:.2} ({lo:.2}-{hi:.2})")
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            key.0,
            key.2,
            key.3,
            key.1,
            f(|s| s.rate),
            f(|s| s.per_cpu),
            g(|s| s.server_cpu),
            g(|s| s.redis_cpu),
            f(|s| s.p50),
            f(|s| s.p99),
            f(|s| s.lag99)
        );
    }
}
