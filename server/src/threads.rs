//! The gRPC port's threads: the connections accepted are handed out in turn to threads that
//! each serve theirs on a single-threaded runtime, one thread per CPU the process may use.
//!
//! A connection's calls are answered on the thread that reads them: no task moves to another
//! thread and no call wakes another one. Measured with `benches/load.rs` on the memory store,
//! this answers about 40% more calls per CPU-second than serving every connection on one
//! multi-threaded runtime did. A connection stays on its thread: few busy connections (Envoy opens
//! one per worker thread) use as many CPUs as there are connections at most.

use std::net::TcpStream;
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::service::Routes;

/// The threads serving the gRPC port.
pub(crate) struct Threads {
    /// Where each thread takes its connections from.
    senders: Vec<mpsc::UnboundedSender<TcpStream>>,
    /// Each thread's end: it has stopped serving.
    done: Vec<oneshot::Receiver<()>>,
    next: usize,
}

impl Threads {
    /// Starts `count` threads (at least one) serving `routes`. Once `stopped` turns `true`, each
    /// stops accepting and finishes its calls under way, then closes the connections still open
    /// after `grace`.
    pub(crate) fn start(
        count: usize,
        routes: &Routes,
        stopped: &watch::Receiver<bool>,
        grace: Duration,
    ) -> std::io::Result<Self> {
        let mut threads = Self { senders: Vec::new(), done: Vec::new(), next: 0 };
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (tx, rx) = mpsc::unbounded_channel();
            let (done, finished) = oneshot::channel();
            let routes = routes.clone();
            let stopped = stopped.clone();
            std::thread::Builder::new().name(format!("tollgate-grpc-{i}")).spawn(move || {
                runtime.block_on(serve(routes, rx, stopped, grace));
                // Dropping the runtime closes the connections still open.
                drop(runtime);
                let _ = done.send(());
            })?;
            threads.senders.push(tx);
            threads.done.push(finished);
        }
        Ok(threads)
    }

    /// Hands `stream` (just accepted) to the next thread.
    pub(crate) fn hand(&mut self, stream: TcpStream) {
        let i = self.next % self.senders.len();
        self.next = self.next.wrapping_add(1);
        // A thread only stops taking connections once stopping: the connection is closed.
        let _ = self.senders[i].send(stream);
    }

    /// Waits until every thread has stopped serving (they stop once `stopped` turns `true`).
    pub(crate) async fn join(self) {
        drop(self.senders);
        for d in self.done {
            let _ = d.await;
        }
    }
}

/// One thread's server: the connections from `rx` until `stopped`, then `grace` for those still
/// open.
async fn serve(
    routes: Routes,
    mut rx: mpsc::UnboundedReceiver<TcpStream>,
    stopped: watch::Receiver<bool>,
    grace: Duration,
) {
    let incoming = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
        .map(tokio::net::TcpStream::from_std);
    let mut signal = stopped.clone();
    let stopping = async move {
        let _ = signal.wait_for(|s| *s).await;
    };
    let serve = tonic::transport::Server::builder()
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, stopping);
    // Stopping, the server answers the calls under way and sends GOAWAY; clients that keep
    // their connections open anyway (Envoy does) are cut off after the grace period.
    let mut deadline = stopped;
    let cut_off = async move {
        let _ = deadline.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        served = serve => {
            if let Err(e) = served {
                tracing::error!(error = %e, "tollgate-server: the gRPC port failed");
            }
        }
        () = cut_off => {
            tracing::info!("tollgate-server: closing the connections still open after {grace:?}");
        }
    }
}
