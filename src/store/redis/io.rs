//! The store's own thread for talking to Redis.
//!
//! Script calls, their connections and their timers run on a single-threaded tokio runtime in
//! a thread of the store's own, not among the application's tasks. A burst of requests, or
//! cores busy with other work, can leave thousands of tasks queued on the application's
//! runtime; a reply read behind them would look like a slow server (and trip timeouts and the
//! breaker) when the server had answered in a millisecond. On its own thread a reply is read
//! as soon as the operating system runs the thread, which, mostly asleep, it does promptly:
//! what the store measures is the server. Answers go back to the waiting checks through
//! channels, so the application's tasks only wait, wherever they run.
//!
//! The thread starts on first use and ends when the store (every clone) is dropped; calls
//! still in flight then are abandoned.

use std::sync::OnceLock;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::error::StoreError;

pub(crate) struct Io {
    started: OnceLock<Result<Running, String>>,
}

struct Running {
    handle: Handle,
    /// Dropped with the store: the thread then returns and drops its runtime.
    _stop: oneshot::Sender<()>,
}

impl Io {
    pub(crate) fn new() -> Self {
        Self { started: OnceLock::new() }
    }

    /// The runtime of the store's thread, started on first use.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the thread could not be started (the system refused a
    /// thread or its event loop).
    pub(crate) fn handle(&self) -> Result<&Handle, StoreError> {
        match self.started.get_or_init(start) {
            Ok(running) => Ok(&running.handle),
            Err(why) => Err(StoreError::backend(why.clone())),
        }
    }
}

fn start() -> Result<Running, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("could not start the redis store's runtime: {e}"))?;
    let handle = runtime.handle().clone();
    let (stop, stopped) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("tollgate-redis".into())
        .spawn(move || {
            runtime.block_on(async {
                let _ = stopped.await;
            });
        })
        .map_err(|e| format!("could not start the redis store's thread: {e}"))?;
    Ok(Running { handle, _stop: stop })
}
