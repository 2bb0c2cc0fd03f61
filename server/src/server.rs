//! Serving: the gRPC port (`ShouldRateLimit` and the gRPC health service), the HTTP port
//! (`/healthcheck`, and `/metrics` when metrics are on), the Prometheus port, the reload of
//! the configuration, and a graceful shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;

use crate::config::{Config, LoadOptions, Source, read_sources};
use crate::engine::Backends;
use crate::service::{Options, RateLimiter};
use crate::settings::Settings;
use crate::stats;
use crate::threads::Threads;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration was refused.
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    /// A port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The threads serving the gRPC port could not be started.
    #[error("cannot start the gRPC threads: {0}")]
    Threads(std::io::Error),
    /// Redis could not be reached.
    #[error("cannot reach Redis: {0}")]
    Redis(tollgate::StoreError),
}

/// A running server.
#[derive(Debug)]
pub struct Running {
    /// The gRPC address bound.
    pub grpc: SocketAddr,
    /// The HTTP address bound (`/healthcheck`).
    pub http: Option<SocketAddr>,
    /// The Prometheus address bound.
    pub metrics: Option<SocketAddr>,
    /// The service, for tests and reloads.
    pub service: RateLimiter,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    /// Stops serving gracefully: health turns NOT_SERVING, the ports stop accepting, and the
    /// calls under way finish.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Waits until the server stops.
    pub async fn wait(self) {
        let _ = self.task.await;
    }

    /// A handle that stops the server when sent `true`.
    #[must_use]
    pub fn stopper(&self) -> watch::Sender<bool> {
        self.stop.clone()
    }
}

/// Where the configuration comes from, and what was last loaded from it.
struct Watched {
    path: PathBuf,
    extensions: Option<PathBuf>,
    options: LoadOptions,
    last: Vec<Source>,
}

impl Watched {
    /// Loads the configuration again if a file changed; `None` when none did.
    fn poll(&mut self, backends: &Backends) -> Option<Result<Config, crate::config::ConfigError>> {
        let sources = match read_all(&self.path, self.extensions.as_deref()) {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        if sources == self.last {
            return None;
        }
        let result = Config::build(&sources, self.options, backends);
        // A refused file is not retried until it changes again.
        self.last = sources;
        Some(result)
    }
}

/// Loads the configuration, binds the ports and serves until stopped. `prometheus` renders the
/// metrics (installed by the caller, as the recorder is process-wide).
///
/// # Errors
/// [`StartError`] when the configuration is refused, Redis cannot be reached or a port cannot
/// be bound.
pub async fn start(
    settings: Settings,
    prometheus: Option<PrometheusHandle>,
) -> Result<Running, StartError> {
    let backends = match &settings.redis {
        None => Backends::memory(),
        Some(target) => Backends::redis(
            target.clone(),
            settings.redis_timeout,
            &settings.cache_key_prefix,
            settings.jitter_max,
            None,
        )
        .await
        .map_err(StartError::Redis)?,
    };
    start_with(settings, prometheus, Arc::new(backends)).await
}

/// [`start`] on stores made by the caller (a test's, on a fake clock).
///
/// # Errors
/// As [`start`].
pub async fn start_with(
    settings: Settings,
    prometheus: Option<PrometheusHandle>,
    backends: Arc<Backends>,
) -> Result<Running, StartError> {
    let options = LoadOptions { merge_domains: settings.merge_domains };
    let sources = read_all(&settings.config, settings.extensions.as_deref())?;
    let config = match Config::build(&sources, options, &backends) {
        Ok(c) => c,
        Err(e) => {
            stats::config_load(false);
            return Err(e.into());
        }
    };
    stats::config_load(true);
    let (domains, limits) = (config.domain_names().len(), config.limits);
    let service = RateLimiter::new(
        config,
        backends.clone(),
        Options {
            near_limit_ratio: settings.near_limit_ratio,
            shadow_mode: settings.shadow_mode,
            headers: settings.headers,
            header_names: settings.header_names.clone(),
        },
    );
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source })
    };
    let grpc_listener = bind(settings.listen).await?;
    let grpc = grpc_listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr: settings.listen, source })?;
    let http_listener = match settings.http {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let metrics_listener = match (settings.metrics, &prometheus) {
        (Some(a), Some(_)) => Some(bind(a).await?),
        _ => None,
    };
    let http = http_listener.as_ref().and_then(|l| l.local_addr().ok());
    let metrics = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());

    let (stop, stopped) = watch::channel(false);
    let healthy = Arc::new(AtomicBool::new(true));
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<RateLimiter>>().await;
    reporter.set_service_status("", ServingStatus::Serving).await;

    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    let signal = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    if let Some(listener) = http_listener {
        let app = http_routes(healthy.clone(), prometheus.clone(), &settings.metrics_path);
        let stopping = signal(stopped.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stopping).await {
                tracing::error!(error = %e, "tollgate-server: the HTTP port failed");
            }
        }));
    }
    if let Some(listener) = metrics_listener {
        let app = http_routes(healthy.clone(), prometheus.clone(), &settings.metrics_path);
        let stopping = signal(stopped.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stopping).await {
                tracing::error!(error = %e, "tollgate-server: the metrics port failed");
            }
        }));
    }
    // Reload: look at the files every `watch`, and at once on SIGHUP.
    {
        let mut watched = Watched {
            path: settings.config.clone(),
            extensions: settings.extensions.clone(),
            options,
            last: sources,
        };
        let service = service.clone();
        let backends = backends.clone();
        let mut stopped = stopped.clone();
        let every = settings.watch;
        tasks.push(tokio::spawn(async move {
            let mut hup = hangup();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = hup.recv() => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
                if let Some(result) = watched.poll(&backends) {
                    match result {
                        Ok(config) => {
                            stats::config_load(true);
                            tracing::info!(
                                domains = config.domain_names().len(),
                                limits = config.limits,
                                "tollgate-server: configuration reloaded"
                            );
                            service.reload(config);
                        }
                        Err(e) => {
                            stats::config_load(false);
                            tracing::error!("tollgate-server: configuration refused, the running limits stay: {e}");
                        }
                    }
                }
            }
        }));
    }

    let routes = tonic::service::Routes::new(health_service)
        .add_service(RateLimitServiceServer::new(service.clone()));
    let count = std::thread::available_parallelism().map_or(1, usize::from);
    let mut threads =
        Threads::start(count, &routes, &stopped, settings.grace).map_err(StartError::Threads)?;
    let mut stopping = stopped.clone();
    let task = tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = grpc_listener.accept() => accepted,
                _ = stopping.wait_for(|s| *s) => break,
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    match stream.into_std() {
                        Ok(s) => threads.hand(s),
                        Err(e) => {
                            tracing::debug!(error = %e, "tollgate-server: a connection was lost")
                        }
                    }
                }
                Err(e) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    tracing::debug!(error = %e, "tollgate-server: accepting failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        // Health turns NOT_SERVING before the port closes.
        healthy.store(false, Ordering::SeqCst);
        reporter.set_not_serving::<RateLimitServiceServer<RateLimiter>>().await;
        reporter.set_service_status("", ServingStatus::NotServing).await;
        drop(grpc_listener);
        threads.join().await;
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    });
    let store = if backends.is_redis() { "Redis" } else { "memory" };
    tracing::info!(
        "tollgate-server: serving ShouldRateLimit on {grpc} ({store} store; {domains} domains, {limits} limits from {})",
        settings.config.display()
    );
    Ok(Running { grpc, http, metrics, service, stop, task })
}

/// The sources at `config`, and the companion files at `extensions` (only names ending in
/// `.tollgate.yaml` count there).
fn read_all(
    config: &Path,
    extensions: Option<&Path>,
) -> Result<Vec<Source>, crate::config::ConfigError> {
    let mut sources = read_sources(config)?;
    if let Some(path) = extensions {
        let more = read_sources(path)?;
        if let Some(bad) = more.iter().find(|s| !s.is_extension()) {
            return Err(crate::config::ConfigError::whole(
                &bad.name,
                "--extensions holds companion files only (names ending in .tollgate.yaml)",
            ));
        }
        sources.extend(more);
    }
    Ok(sources)
}

fn http_routes(
    healthy: Arc<AtomicBool>,
    prometheus: Option<PrometheusHandle>,
    metrics_path: &str,
) -> Router {
    let mut app = Router::new().route(
        "/healthcheck",
        get(move || {
            let ok = healthy.load(Ordering::SeqCst);
            async move {
                if ok {
                    (StatusCode::OK, "OK")
                } else {
                    (StatusCode::INTERNAL_SERVER_ERROR, "NOT OK")
                }
            }
        }),
    );
    if let Some(handle) = prometheus {
        app = app.route(metrics_path, get(move || std::future::ready(handle.render())));
    }
    app
}

/// SIGHUP, on Unix; never elsewhere.
fn hangup() -> Hangup {
    #[cfg(unix)]
    {
        Hangup(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok())
    }
    #[cfg(not(unix))]
    {
        Hangup(None)
    }
}

struct Hangup(
    #[cfg(unix)] Option<tokio::signal::unix::Signal>,
    #[cfg(not(unix))] Option<std::convert::Infallible>,
);

impl Hangup {
    async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(s) = &mut self.0 {
            s.recv().await;
            return;
        }
        std::future::pending::<()>().await;
    }
}
