//! Requests per second of a trivial axum handler with and without the `Idempotency-Key` layer,
//! over the memory and SQLite stores, in one run. The bare handler and the store's own
//! `claim` + `complete` are the primitives the layer's rows stand beside.
//!
//! ```sh
//! cargo run --release -p idem-http --example bench_http -- --requests 20000 --concurrency 32
//! ```
//!
//! Server and load generator share one process (and the machine's cores), over loopback TCP
//! with keep-alive connections, one per client task.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, MemoryStore};
use idem_http::IdempotencyKeyLayer;
use idem_sqlx::SqliteStore;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};

struct Args {
    requests: u64,
    concurrency: u64,
    synchronous: SqliteSynchronous,
}

fn args() -> Args {
    let mut a = Args { requests: 20_000, concurrency: 32, synchronous: SqliteSynchronous::Full };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--requests" => a.requests = value.parse().expect("--requests N"),
            "--concurrency" => a.concurrency = value.parse().expect("--concurrency N"),
            "--synchronous" => {
                a.synchronous = match value.as_str() {
                    "normal" => SqliteSynchronous::Normal,
                    _ => SqliteSynchronous::Full,
                }
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

async fn handler(body: Bytes) -> String {
    format!(r#"{{"ok":true,"len":{}}}"#, body.len())
}

async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

fn app() -> Router {
    Router::new().route("/pay", post(handler))
}

#[derive(Clone, Copy)]
enum Keys {
    None,
    /// A fresh key per request: every request runs the handler and stores its response.
    Unique,
    /// Keys `0..64`, stored beforehand: every request is a replay.
    Replay,
}

struct Row {
    name: String,
    rps: f64,
    p50: Duration,
    p99: Duration,
}

async fn load(name: &str, addr: SocketAddr, keys: Keys, a: &Args, run: u64) -> Row {
    if matches!(keys, Keys::Replay) {
        for k in 0..64 {
            let mut c = Client::connect(addr).await;
            c.post(Some(format!("replay-{run}-{k}"))).await;
        }
    }
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..a.concurrency)
        .map(|_| {
            let next = Arc::clone(&next);
            let total = a.requests;
            tokio::spawn(async move {
                let mut c = Client::connect(addr).await;
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break lat;
                    }
                    let key = match keys {
                        Keys::None => None,
                        Keys::Unique => Some(format!("k-{run}-{i}")),
                        Keys::Replay => Some(format!("replay-{run}-{}", i % 64)),
                    };
                    let t = Instant::now();
                    c.post(key).await;
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("client task"));
    }
    let elapsed = started.elapsed();
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    Row {
        name: name.to_owned(),
        rps: a.requests as f64 / elapsed.as_secs_f64(),
        p50: pct(50),
        p99: pct(99),
    }
}

struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: String,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(conn);
        Self { sender, host: addr.to_string() }
    }

    async fn post(&mut self, key: Option<String>) {
        let mut req = hyper::Request::post("/pay")
            .header("host", &self.host)
            .header("content-type", "application/json");
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let req = req.body(Full::new(Bytes::from_static(br#"{"cents":1200,"currency":"EUR"}"#)));
        self.sender.ready().await.expect("ready");
        let res = self.sender.send_request(req.expect("request")).await.expect("response");
        assert!(res.status().is_success(), "status {}", res.status());
        res.into_body().collect().await.expect("body");
    }
}

/// The store's own claim + complete per key, `concurrency` tasks: the ceiling for the layer.
async fn raw_store<St: DedupStore + Clone + 'static>(name: &str, store: St, a: &Args) -> Row {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..a.concurrency)
        .map(|_| {
            let (store, next, total) = (store.clone(), Arc::clone(&next), a.requests);
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break lat;
                    }
                    let t = Instant::now();
                    let key = DedupKey::new("raw", format!("k-{i}")).expect("key");
                    let req = ClaimRequest::new(
                        key,
                        None,
                        Duration::from_secs(30),
                        Duration::from_secs(86_400),
                    );
                    let Claim::Acquired(lease) = store.claim(&req).await.expect("claim") else {
                        panic!("fresh key not acquired")
                    };
                    store
                        .complete(
                            lease,
                            Some(b"0123456789abcdef0123456789abcdef0123456789"),
                            Duration::from_secs(86_400),
                        )
                        .await
                        .expect("complete");
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("task"));
    }
    let elapsed = started.elapsed();
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    Row {
        name: name.to_owned(),
        rps: a.requests as f64 / elapsed.as_secs_f64(),
        p50: pct(50),
        p99: pct(99),
    }
}

async fn sqlite(dir: &std::path::Path, name: &str, sync: SqliteSynchronous) -> SqliteStore {
    let opts = SqliteConnectOptions::new()
        .filename(dir.join(name))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(sync)
        .busy_timeout(Duration::from_secs(5));
    SqliteStore::open_with(opts).await.expect("sqlite")
}

#[tokio::main]
async fn main() {
    let a = args();
    let dir = tempfile::tempdir().expect("tempdir");
    let sync = match a.synchronous {
        SqliteSynchronous::Normal => "NORMAL",
        _ => "FULL",
    };
    println!(
        "{} requests per row, {} keep-alive connections, SQLite WAL synchronous = {sync}",
        a.requests, a.concurrency
    );
    let bare = serve(app()).await;
    // The benchmark's requests have no authentication, so no principal.
    let mem =
        serve(app().layer(IdempotencyKeyLayer::new(MemoryStore::new()).allow_anonymous())).await;
    let lite = serve(
        app().layer(
            IdempotencyKeyLayer::new(sqlite(dir.path(), "http.sqlite", a.synchronous).await)
                .allow_anonymous(),
        ),
    )
    .await;
    let raw_lite = sqlite(dir.path(), "raw.sqlite", a.synchronous).await;

    // Warm up each server (connections, allocator, SQLite pages).
    let warm = Args { requests: 500, ..a };
    for (addr, keys) in [(bare, Keys::None), (mem, Keys::Unique), (lite, Keys::Unique)] {
        load("warm", addr, keys, &warm, 0).await;
    }

    let rows = vec![
        load("bare handler, no layer", bare, Keys::None, &a, 1).await,
        load("layer + MemoryStore, new key per request", mem, Keys::Unique, &a, 1).await,
        load("layer + MemoryStore, replays", mem, Keys::Replay, &a, 1).await,
        load("layer + MemoryStore, no key (pass-through)", mem, Keys::None, &a, 1).await,
        raw_store("raw MemoryStore claim + complete (no HTTP)", MemoryStore::new(), &a).await,
        load("layer + SqliteStore, new key per request", lite, Keys::Unique, &a, 1).await,
        load("layer + SqliteStore, replays", lite, Keys::Replay, &a, 1).await,
        raw_store("raw SqliteStore claim + complete (no HTTP)", raw_lite, &a).await,
    ];
    let base = rows[0].rps;
    println!();
    println!("| measurement | req/s | vs bare | p50 | p99 |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.2}× | {:.2} ms | {:.2} ms |",
            r.name,
            r.rps,
            r.rps / base,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3
        );
    }
}
