//! A TCP proxy a test puts between a client and its server to inject what a link cut cannot:
//! a stalled connection (open, acknowledged by TCP, but nothing forwarded), added latency, and
//! closing every connection at once.
//!
//! With a [`Netns`](crate::netns::Netns), a proxy in the root namespace listening on the
//! namespace's [`host_ip`](crate::netns::Netns::host_ip) is how a process inside the namespace
//! reaches a server that listens on loopback.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> std::io::Result<()> {
//! use idem_testkit::proxy::Proxy;
//! let proxy = Proxy::start("127.0.0.1:0", "127.0.0.1:5432".parse().unwrap()).await?;
//! let url = format!("postgres://postgres@{}/test", proxy.addr());
//! proxy.stall(); // the client's reads now block; keepalives would still be answered
//! proxy.resume();
//! proxy.close_all(); // every connection closed; new ones are accepted
//! # drop(url); Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does to the bytes it forwards.
#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    stalled: bool,
    latency: Duration,
    /// Bumped by [`Proxy::close_all`]: connections opened before end.
    generation: u64,
}

/// A TCP proxy to one upstream address; stops accepting and closes its connections on drop.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    accepted: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on `listen` (port 0 for a free one) and forwards every connection to `upstream`.
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start(listen: impl ToSocketAddrs, upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (faults, _) = watch::channel(Faults::default());
        let accepted = Arc::new(AtomicU64::new(0));
        let (tx, count) = (faults.clone(), Arc::clone(&accepted));
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(client, upstream, tx.subscribe()));
            }
        });
        Ok(Self { addr, faults, accepted, accept })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Stops forwarding in both directions, keeping every connection open: the peers' TCP
    /// stacks still acknowledge (so TCP keepalive sees a live peer), but no byte arrives.
    pub fn stall(&self) {
        self.faults.send_modify(|f| f.stalled = true);
    }

    /// Forwards again what [`stall`](Self::stall) held.
    pub fn resume(&self) {
        self.faults.send_modify(|f| f.stalled = false);
    }

    /// Delays every chunk forwarded, either way, by `d` (zero: none).
    pub fn latency(&self, d: Duration) {
        self.faults.send_modify(|f| f.latency = d);
    }

    /// Closes every open connection (both sockets); later connections are forwarded as usual.
    pub fn close_all(&self) {
        self.faults.send_modify(|f| f.generation += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.close_all();
    }
}

/// One connection: both directions until both ended or [`Proxy::close_all`].
async fn forward(client: TcpStream, upstream: SocketAddr, mut faults: watch::Receiver<Faults>) {
    let born = faults.borrow().generation;
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let (up, down) = (faults.clone(), faults.clone());
    let both = async move {
        tokio::join!(pump(cr, sw, up), pump(sr, cw, down));
    };
    tokio::select! {
        () = both => {}
        _ = faults.wait_for(|f| f.generation != born) => {}
    }
}

/// Copies `from` to `to` chunk by chunk, holding each while stalled and delaying it by the
/// latency; passes the end of stream on.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut faults: watch::Receiver<Faults>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // Not reading while stalled lets TCP flow control hold the sender back.
        if faults.wait_for(|f| !f.stalled).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let latency = faults.borrow().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if faults.wait_for(|f| !f.stalled).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server and a proxy in front of it.
    async fn echo_behind_proxy() -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        Proxy::start("127.0.0.1:0", upstream).await.unwrap()
    }

    async fn echo(c: &mut TcpStream, what: &[u8]) -> std::io::Result<Vec<u8>> {
        c.write_all(what).await?;
        let mut got = vec![0u8; what.len()];
        c.read_exact(&mut got).await?;
        Ok(got)
    }

    #[tokio::test]
    async fn forwards_stalls_resumes_and_closes() {
        let proxy = echo_behind_proxy().await;
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut c, b"one").await.unwrap(), b"one");

        proxy.stall();
        let held = tokio::time::timeout(Duration::from_millis(300), echo(&mut c, b"two")).await;
        assert!(held.is_err(), "a stalled proxy forwarded");
        proxy.resume();
        let mut got = vec![0u8; 3];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, b"two", "what was held arrives after resume");

        proxy.latency(Duration::from_millis(100));
        let t = tokio::time::Instant::now();
        assert_eq!(echo(&mut c, b"three").await.unwrap(), b"three");
        assert!(t.elapsed() >= Duration::from_millis(200), "latency each way");
        proxy.latency(Duration::ZERO);

        proxy.close_all();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "the connection was not closed");
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut again, b"four").await.unwrap(), b"four");
        assert_eq!(proxy.accepted(), 2);
    }
}
