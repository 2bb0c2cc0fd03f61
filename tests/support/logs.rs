//! Log events captured from `tracing`, for tests that check what the layer logs.
//!
//! One global subscriber (at `DEBUG`, installed once per test binary) writes each event to the
//! capture of the thread that emitted it, if that thread started one. A global subscriber,
//! rather than one scoped per test, keeps every call site enabled: with scoped subscribers, a
//! test on another thread without one can leave a call site's cached interest at "never"
//! while this test's subscriber is being registered, and its events are then lost.
//! `#[tokio::test]` runs the test and the tasks it spawns (servers included) on its own
//! thread, so their events land in its capture.

use std::cell::RefCell;
use std::io::Write;
use std::sync::{Arc, Mutex, Once};

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// A capture's buffer.
type Lines = Arc<Mutex<Vec<u8>>>;

thread_local! {
    static CAPTURE: RefCell<Option<(Level, Lines)>> = const { RefCell::new(None) };
}

/// The log lines of this thread at `level` and above, from `start` until dropped.
pub struct Captured {
    lines: Lines,
}

impl Captured {
    /// Starts capturing this thread's events at `level` and above.
    pub fn start(level: Level) -> Self {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(Level::DEBUG)
                .with_ansi(false)
                .without_time()
                .with_writer(PerThread)
                .finish();
            tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        });
        let lines = Arc::new(Mutex::new(Vec::new()));
        CAPTURE.with(|c| *c.borrow_mut() = Some((level, Arc::clone(&lines))));
        Self { lines }
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.lines.lock().unwrap().clone()).unwrap()
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        CAPTURE.with(|c| *c.borrow_mut() = None);
    }
}

/// Writes each event to the capture of the thread that emitted it.
struct PerThread;

/// One event's writer: the capture's buffer, or nowhere.
struct Sink(Option<Lines>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(lines) = &self.0 {
            lines.lock().unwrap().extend_from_slice(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for PerThread {
    type Writer = Sink;

    fn make_writer(&'a self) -> Sink {
        Sink(None)
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Sink {
        CAPTURE.with(|c| {
            Sink(
                c.borrow().as_ref().and_then(|(level, lines)| {
                    (*meta.level() <= *level).then(|| Arc::clone(lines))
                }),
            )
        })
    }
}
