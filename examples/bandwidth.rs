//! Upload bandwidth per API key, limited while the uploads stream.
//!
//! An axum server on a loopback port limits each API key to 256 KB/s of request bytes (with a
//! burst of 256 KB), counted as chunked uploads arrive. With `StreamMode::Shape` the server
//! stops reading a key's uploads when they run ahead of the rate (backpressure), so three
//! concurrent 256 KB uploads of one key take about two seconds together while another key's
//! upload is not slowed; with `StreamMode::Police` an upload past the tier is answered 429.
//!
//! Run with `cargo run --example bandwidth` (about three seconds).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderName, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::key::HeaderKey;
use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};

const KB: u64 = 1_000;

/// A chunked body (no `Content-Length`) of `left` bytes, sent in frames of 16 KiB.
struct Chunked {
    left: u64,
    frame: Bytes,
}

impl Chunked {
    fn new(len: u64) -> Self {
        Self { left: len, frame: Bytes::from(vec![b'x'; 16 * 1024]) }
    }
}

impl Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let len = (self.frame.len() as u64).min(self.left);
        self.left -= len;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        Poll::Ready(Some(Ok(Frame::data(self.frame.slice(..len)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Serves `/upload` (answers the number of bytes read) under a 256 KB/s byte tier per
/// `x-api-key`, metered as the body streams in `mode`. Returns the server's address.
async fn serve(mode: StreamMode) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let policy = Policy::builder("uploads")
        .tier("upload-bytes", Quota::per_second(256 * KB).counting(Unit::RequestBytes))
        .build()?;
    let layer = RateLimitLayer::builder(policy)
        .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
        .on_stream(mode)
        .build()?;
    let app = Router::new()
        .route(
            "/upload",
            post(|req: Request| async move {
                let mut body = req.into_body();
                let mut read = 0usize;
                while let Some(frame) = body.frame().await {
                    match frame {
                        Ok(frame) => read += frame.data_ref().map_or(0, Bytes::len),
                        Err(_) => return (StatusCode::BAD_REQUEST, "upload cut".to_owned()),
                    }
                }
                (StatusCode::OK, read.to_string())
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Uploads `len` bytes chunked as `key`: the status and how long the upload took.
async fn upload(
    addr: SocketAddr,
    key: &'static str,
    len: u64,
) -> Result<(StatusCode, Duration), Box<dyn std::error::Error + Send + Sync>> {
    let client: Client<_, Chunked> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("http://{addr}/upload"))
        .header("x-api-key", key)
        .body(Chunked::new(len))?;
    let start = Instant::now();
    let res = client.request(req).await?;
    let status = res.status();
    res.into_body().collect().await?;
    Ok((status, start.elapsed()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Shaping: alice's three uploads share her 256 KB/s (her burst covers the first 256 KB,
    // the other 512 KB take about two seconds); bob's upload is not slowed by hers.
    let addr = serve(StreamMode::Shape).await?;
    let start = Instant::now();
    // Each upload's end, counted from `start`.
    let timed = |key| async move {
        let (status, _) = upload(addr, key, 256 * KB).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, start.elapsed()))
    };
    let alice: Vec<_> = (0..3).map(|_| tokio::spawn(timed("alice"))).collect();
    let bob = tokio::spawn(timed("bob"));
    let mut alice_took = Duration::ZERO;
    for u in alice {
        let (status, done) = u.await?.map_err(|e| e.to_string())?;
        assert_eq!(status, StatusCode::OK);
        alice_took = alice_took.max(done);
    }
    let (status, bob_took) = bob.await?.map_err(|e| e.to_string())?;
    assert_eq!(status, StatusCode::OK);
    println!(
        "shape:  alice's 3 x 256 KB took {:.2} s together, bob's 256 KB took {:.2} s \
         (256 KB/s per key, burst 256 KB)",
        alice_took.as_secs_f64(),
        bob_took.as_secs_f64()
    );
    assert!(alice_took >= Duration::from_millis(1_800), "shaped to 256 KB/s: {alice_took:?}");
    assert!(bob_took < alice_took, "another key's upload is not slowed");

    // Policing: carol's first upload fits her burst; a second one right after runs out of
    // her tier mid-way and is answered 429 in the handler's place.
    let addr = serve(StreamMode::Police).await?;
    let (first, _) = upload(addr, "carol", 200 * KB).await.map_err(|e| e.to_string())?;
    let second = upload(addr, "carol", 200 * KB).await.map_err(|e| e.to_string());
    println!("police: carol's first 200 KB upload: {first}; the second, right after: {second:?}");
    assert_eq!(first, StatusCode::OK);
    // The server answers 429 while the client may still be sending: the client sees either
    // the 429 or the connection closed under it, never a stored upload.
    assert!(!matches!(second, Ok((StatusCode::OK, _))), "{second:?}");
    Ok(())
}
