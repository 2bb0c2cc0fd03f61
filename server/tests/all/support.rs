//! Starting a server on a fake clock, and building requests.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tollgate::clock::FakeClock;
use tollgate_server::engine::Backends;
use tollgate_server::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate_server::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate_server::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate_server::server::{Running, start_with};
use tollgate_server::settings::Settings;
use tonic::transport::Channel;

/// A Unix time at which every window of every unit starts (a multiple of 365, 30 and 7 days).
pub const T0: u64 = 86_400 * 15_330;

/// A fresh directory under the system's temporary one.
pub fn temp_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tollgate-server-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A server, its files, its clock and a client.
pub struct Server {
    pub running: Running,
    pub dir: PathBuf,
    pub clock: FakeClock,
    pub client: RateLimitServiceClient<Channel>,
}

impl Server {
    /// Calls ShouldRateLimit.
    pub async fn call(&mut self, request: RateLimitRequest) -> RateLimitResponse {
        self.client.should_rate_limit(request).await.expect("the call fails").into_inner()
    }

    /// Calls ShouldRateLimit and returns the codes: overall, then per descriptor.
    pub async fn codes(&mut self, request: RateLimitRequest) -> (Code, Vec<Code>) {
        let r = self.call(request).await;
        (code(r.overall_code), r.statuses.iter().map(|s| code(s.code)).collect())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

pub fn code(c: i32) -> Code {
    Code::try_from(c).unwrap()
}

/// Serves `files` (name, text) from a directory with `args` besides `--config` and
/// `--listen`, on the memory store at [`T0`].
pub async fn serve(files: &[(&str, &str)], args: &[&str]) -> Server {
    let clock = FakeClock::new();
    clock.set(T0 * 1_000_000_000);
    let backends = Arc::new(Backends::memory_with_clock(clock.clone()));
    serve_on(files, args, backends, clock).await
}

/// As [`serve`], on `backends`.
pub async fn serve_on(
    files: &[(&str, &str)],
    args: &[&str],
    backends: Arc<Backends>,
    clock: FakeClock,
) -> Server {
    let dir = temp_dir();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let mut all: Vec<String> =
        vec!["--config".into(), dir.display().to_string(), "--listen".into(), "127.0.0.1:0".into()];
    all.extend(args.iter().map(|s| (*s).to_owned()));
    let settings = Settings::parse(all, |_| None).unwrap();
    let running = start_with(settings, None, backends).await.unwrap();
    let client = RateLimitServiceClient::connect(format!("http://{}", running.grpc)).await.unwrap();
    Server { running, dir, clock, client }
}

/// A descriptor of `entries`.
pub fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() })
            .collect(),
        ..Default::default()
    }
}

/// A request of `descriptors` in `domain`.
pub fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest { domain: domain.into(), descriptors, hits_addend: 0 }
}

/// A request of one descriptor.
pub fn one(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
    req(domain, vec![desc(entries)])
}

/// Calls `request` `n` times and counts the overall OKs.
pub async fn admitted(server: &mut Server, request: &RateLimitRequest, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if server.codes(request.clone()).await.0 == Code::Ok {
            ok += 1;
        }
    }
    ok
}
