//! `tollgate-server --config <file or directory> --listen <addr:port> [--redis <url>]`: the rate
//! limit service for Envoy. See the README.

use std::process::ExitCode;

/// mimalloc: glibc's malloc took a fifth of the CPU time of a call (benches/load.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use tollgate_server::server;
use tollgate_server::settings::Settings;

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tollgate-server: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run());
    // Nothing is left to finish: the calls under way were answered before `run` returned.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

async fn run() -> ExitCode {
    let env = |name: &str| std::env::var(name).ok();
    let settings = match Settings::parse(std::env::args().skip(1), env) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tollgate-server: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_max_level(settings.log_level)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    Settings::warn_unsupported(env);
    let prometheus = if settings.metrics.is_some() {
        match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
            Ok(h) => Some(h),
            Err(e) => {
                eprintln!("tollgate-server: cannot install the metrics recorder: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let running = match server::start(settings, prometheus).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tollgate-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stop = running.stopper();
    tokio::spawn(async move {
        terminate().await;
        tracing::info!("tollgate-server: stopping (finishing the calls under way)");
        let _ = stop.send(true);
    });
    running.wait().await;
    tracing::info!("tollgate-server: stopped");
    ExitCode::SUCCESS
}

/// SIGTERM or Ctrl-C.
async fn terminate() {
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match &mut term { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
