//! A throw-away `redis-server` for the examples that need one: a free port on 127.0.0.1, no
//! persistence (`--save ""`), killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` an example started; killed on drop.
pub(crate) struct ThrowAwayRedis(Child);

impl Drop for ThrowAwayRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `redis-server` on a free loopback port and waits (up to 10 s) until it accepts
/// connections: the server and its URL.
///
/// # Errors
/// When `redis-server` is not installed or does not start within 10 s.
pub(crate) fn start_redis() -> Result<(ThrowAwayRedis, String), Box<dyn std::error::Error>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "no", "--dir"])
        .arg(std::env::temp_dir())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server ({e}); install it"))?;
    let server = ThrowAwayRedis(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("redis-server did not start within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((server, format!("redis://127.0.0.1:{port}/")))
}
