//! The listener's bounds, each shown by a client that would hold the server without it: a gRPC
//! message declared large and sent without a token, headers sent a byte at a time, one
//! connection over the limit, a request cut by the drain after the shutdown signal.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::MemoryStore;
use idem_serve::Limits;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::common::{ADMIN, tokens};

/// Serves a `MemoryStore` within `limits`; the handle's end resolves when `serve` returns.
async fn serve(limits: Limits) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel();
    let app = idem_serve::router(MemoryStore::new(), tokens(), None);
    let done = tokio::spawn(async move {
        idem_serve::serve(app, listener, None, limits, async {
            let _ = rx.await;
        })
        .await
        .expect("serve");
    });
    (addr, tx, done)
}

/// A gRPC message's 5-byte prefix declaring `len` bytes (not compressed).
fn declare(len: u32) -> Bytes {
    let mut b = vec![0u8];
    b.extend_from_slice(&len.to_be_bytes());
    Bytes::from(b)
}

/// An HTTP/2 connection (h2c, prior knowledge) to `addr`.
async fn h2(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Opens a `Claim` call without a token that declares a 4 MiB message and sends `data` bytes of
/// it (never the rest); answers the `grpc-status` the server sent.
async fn unauthenticated_claim(
    client: h2::client::SendRequest<Bytes>,
    addr: SocketAddr,
    data: usize,
) -> (h2::client::SendRequest<Bytes>, Option<String>, h2::SendStream<Bytes>) {
    let mut client = client.ready().await.expect("ready");
    let req = http::Request::post(format!("http://{addr}/idem.v1.Claims/Claim"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
    let (answer, mut body) = client.send_request(req, false).expect("send");
    // The server may refuse the stream on its headers and close it before these are sent (h2
    // then answers `InactiveStreamId`): that is the refusal this file is about, not a failure.
    let _ = body.send_data(declare(4 << 20), false);
    if data > 0 {
        let _ = body.send_data(Bytes::from(vec![b'x'; data]), false);
    }
    let answer = tokio::time::timeout(Duration::from_secs(20), answer)
        .await
        .expect("no answer within 20 s: the server is waiting for the message")
        .expect("answer");
    let status =
        answer.headers().get("grpc-status").map(|v| v.to_str().unwrap_or("not text").to_owned());
    (client, status, body)
}

// A gRPC call without a token is refused on its headers: the answer comes while the declared
// 4 MiB message is still unsent (before the fix, tonic read the whole message first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_without_a_token_is_refused_before_its_message_is_read() {
    let (addr, _stop, _done) = serve(Limits::default()).await;
    let (_client, status, _body) = unauthenticated_claim(h2(addr).await, addr, 0).await;
    assert_eq!(status.as_deref(), Some("16"), "UNAUTHENTICATED expected");
}

// 600 such streams on 6 connections, each offering 64 KiB of its message: the server's peak
// memory stays under 64 MiB (DEPLOYMENT.md's sidecar has 128 MiB). The server runs in a child
// process of its own, so its memory is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_unauthenticated_streams_keep_the_server_under_64_mib() {
    let mut child = tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["limits::server_child", "--exact", "--ignored", "--nocapture"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("child");
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let addr: SocketAddr = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.expect("read") {
            if let Some(a) = line.strip_prefix("ADDR=") {
                return a.parse().expect("address");
            }
        }
        panic!("the child ended without an address");
    })
    .await
    .expect("the child did not start within 60 s");
    let before = peak_kib(pid);
    let mut refused = 0;
    let mut held = Vec::new();
    for _ in 0..6 {
        let mut client = h2(addr).await;
        for _ in 0..100 {
            let (c, status, body) = unauthenticated_claim(client, addr, 64 * 1024).await;
            client = c;
            refused += usize::from(status.as_deref() == Some("16"));
            held.push(body);
        }
    }
    let after = peak_kib(pid);
    assert_eq!(refused, 600, "every stream must be refused UNAUTHENTICATED");
    eprintln!("server peak RSS: {before} KiB before, {after} KiB after 600 streams");
    assert!(after < 64 * 1024, "the server's peak RSS reached {after} KiB (from {before} KiB)");
    drop(held);
    drop(child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
}

/// The peak resident memory of process `pid`, in KiB (`VmHWM`).
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server of six_hundred_unauthenticated_streams_keep_the_server_under_64_mib"]
async fn server_child() {
    let (addr, _stop, _done) = serve(Limits::default()).await;
    println!("ADDR={addr}");
    // Until the parent closes stdin.
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while stdin.read(&mut buf).await.is_ok_and(|n| n > 0) {}
}

/// Sends `GET /healthz` on a fresh connection and answers the status line, or what became of
/// the connection (a connection refused at the limit is reset: the server closed it unread).
async fn healthz(addr: SocketAddr) -> String {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    if let Err(e) =
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await
    {
        return format!("write: {e}");
    }
    let mut text = String::new();
    match tcp.read_to_string(&mut text).await {
        Ok(_) => text.lines().next().unwrap_or_default().to_owned(),
        Err(e) => format!("read: {e}"),
    }
}

// A client that sends its headers one byte every 100 ms is disconnected at the header timeout;
// other clients are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_at_the_header_timeout_while_others_are_served() {
    let timeout = Duration::from_secs(1);
    let (addr, _stop, _done) = serve(Limits::default().header_timeout(timeout)).await;
    let slow = TcpStream::connect(addr).await.expect("connect");
    let started = Instant::now();
    let (mut read, mut write) = slow.into_split();
    let dripping = tokio::spawn(async move {
        let head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-padding: ".iter().copied();
        for byte in head.chain(std::iter::repeat(b'a')) {
            if write.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    for _ in 0..3 {
        assert_eq!(healthz(addr).await, "HTTP/1.1 200 OK", "another client must be served");
    }
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut rest)).await;
    let after = started.elapsed();
    assert!(closed.is_ok(), "the slow client was still connected after 10 s");
    assert!(after >= timeout - Duration::from_millis(100), "cut after {after:?}, before the bound");
    assert!(after < timeout + Duration::from_secs(3), "cut only after {after:?}");
    dripping.abort();
}

// With the limit at 4 open connections, a fifth is closed at once; once one of the four ends,
// a new connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_limit_is_closed_at_once() {
    let (addr, _stop, _done) = serve(Limits::default().max_connections(4)).await;
    let mut open = Vec::new();
    for _ in 0..4 {
        // Served once (so the server holds it), and kept open.
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 15];
        tcp.read_exact(&mut buf).await.expect("answer");
        assert_eq!(&buf, b"HTTP/1.1 200 OK");
        open.push(tcp);
    }
    let mut fifth = TcpStream::connect(addr).await.expect("the kernel accepts the connection");
    let _ = fifth.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), fifth.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the fifth connection was neither closed nor answered within 5 s");
    assert!(
        rest.is_empty(),
        "the fifth connection was served: {:?}",
        String::from_utf8_lossy(&rest)
    );
    drop(open.pop());
    // The server notices the close when it reads it: wait for a served connection.
    idem_testkit::wait_for(
        "a connection served after one of four closed",
        Duration::from_secs(10),
        || async move { healthz(addr).await == "HTTP/1.1 200 OK" },
    )
    .await;
}

/// A `POST /v1/claims` whose body is half sent, once the handler is reading it (the server says
/// `100 Continue` then); answers the connection's halves.
async fn half_sent_claim(
    addr: SocketAddr,
) -> (tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>, tokio::net::tcp::OwnedWriteHalf)
{
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (read, mut write) = tcp.into_split();
    let head = format!(
        "POST /v1/claims HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN}\r\n\
         content-type: application/json\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n"
    );
    write.write_all(head.as_bytes()).await.expect("headers");
    let mut lines = BufReader::new(read).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("no 100 Continue within 10 s")
        .expect("read");
    assert_eq!(first.as_deref(), Some("HTTP/1.1 100 Continue"));
    let _blank = lines.next_line().await.expect("read");
    write.write_all(br#"{"scope":"orders","#).await.expect("half the body");
    (lines, write)
}

// The shutdown signal with a request whose body is half sent: `serve` returns within the drain
// bound (before, the plain listener waited for the body without bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_half_sent_request_ends_within_the_drain_bound() {
    let drain = Duration::from_secs(1);
    let (addr, stop, done) = serve(Limits::default().drain_timeout(drain)).await;
    let (_read, _write) = half_sent_claim(addr).await;
    let started = Instant::now();
    let _ = stop.send(());
    tokio::time::timeout(drain + Duration::from_secs(3), done)
        .await
        .expect("serve did not return within the drain bound and 3 s")
        .expect("serve panicked");
    assert!(started.elapsed() >= drain - Duration::from_millis(100), "the request got no drain");
}

// A body not sent within the request timeout is answered 408 `request_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_not_sent_within_the_request_timeout_is_answered_408() {
    let (addr, _stop, _done) =
        serve(Limits::default().request_timeout(Duration::from_secs(1))).await;
    let started = Instant::now();
    let (mut lines, _write) = half_sent_claim(addr).await;
    let status = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("no answer within 10 s")
        .expect("read");
    assert_eq!(status.as_deref(), Some("HTTP/1.1 408 Request Timeout"));
    assert!(started.elapsed() >= Duration::from_millis(900), "408 after {:?}", started.elapsed());
    let mut rest = String::new();
    while let Ok(Some(line)) = lines.next_line().await {
        rest.push_str(&line);
        if line.contains("request_timeout") {
            break;
        }
    }
    assert!(rest.contains(r#""type":"request_timeout""#), "{rest}");
}

// With one request being answered and the limit at one, the next is answered 503 `busy` at
// once, with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_in_flight_limit_is_answered_busy() {
    let (addr, _stop, _done) = serve(Limits::default().max_in_flight(1)).await;
    let (_read, _write) = half_sent_claim(addr).await;
    // reqwest is built without a crypto provider of its own (idem's clients bring ring).
    let _ = idem_serve::tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let res = reqwest::Client::new()
        .get(format!("http://{addr}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .expect("an answer at once");
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers().get("retry-after").map(|v| v.as_bytes()), Some(&b"1"[..]));
    let problem: serde_json::Value = res.json().await.expect("a problem document");
    assert_eq!(problem["type"], "busy");
    assert_eq!(problem["retryable"], true);
}

// An HTTP/2 connection with no request open for the idle timeout is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_at_the_idle_timeout() {
    let idle = Duration::from_secs(1);
    let (addr, _stop, _done) = serve(Limits::default().idle_timeout(idle)).await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let conn = tokio::spawn(conn);
    let mut client = client.ready().await.expect("ready");
    let req = http::Request::get(format!("http://{addr}/healthz")).body(()).expect("request");
    let (answer, _) = client.send_request(req, true).expect("send");
    assert_eq!(answer.await.expect("answer").status(), 200);
    let served = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), conn)
        .await
        .expect("the idle connection was still open after 10 s")
        .expect("connection task")
        .expect("a clean close (GOAWAY)");
    let after = served.elapsed();
    assert!(after >= idle - Duration::from_millis(100), "closed after {after:?}");
    assert!(after < idle + Duration::from_secs(3), "closed only after {after:?}");
}

// A limit out of range is refused with its key and range.
#[tokio::test]
async fn a_limit_out_of_range_names_its_key() {
    let e = Limits::default().max_connections(0).validate().expect_err("0 connections");
    assert_eq!(e.to_string(), "config: limits.max_connections: is 0; give 1 to 1000000");
    let e = Limits::default().header_timeout(Duration::ZERO).validate().expect_err("0 ms");
    assert!(e.to_string().contains("limits.header_timeout_ms"), "{e}");
    let toml = "[limits]\nmax_in_flight = 8\nidle_timeout_ms = 5000\n";
    let config = idem_serve::config::ServeConfig::from_toml(toml).expect("parses");
    assert_eq!(
        config.limits,
        Limits::default().max_in_flight(8).idle_timeout(Duration::from_secs(5))
    );
    assert!(idem_serve::config::ServeConfig::from_toml("[limits]\nmax_conections = 1\n").is_err());
}
