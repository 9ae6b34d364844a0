//! `idem serve` as a process: SIGTERM with a request whose body is half sent ends the process
//! within the drain bound (the plain listener used to wait for the body without bound), and a
//! SQLite store it creates is readable by its user only.

use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

const TOKEN: &str = "serve-test-secret-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_half_sent_request_exits_within_the_drain_bound() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("serve.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:0\"\n[limits]\ndrain_timeout_ms = 1000\n")
        .expect("config");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("IDEM_STORE", dir.path().join("store.db"))
        .env("IDEM_SERVE_TOKENS", format!("test:*:{TOKEN}"))
        .env_remove("IDEM_SERVE_LISTEN")
        .env_remove("IDEM_SERVE_CONFIG")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("idem serve");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let addr = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.expect("stdout") {
            if let Some(a) = line.strip_prefix("listening on http://") {
                return a.to_owned();
            }
        }
        panic!("idem serve ended without listening");
    })
    .await
    .expect("idem serve did not listen within 60 s");

    // The store file was created readable by the service's user only.
    use std::os::unix::fs::PermissionsExt as _;
    let mode =
        std::fs::metadata(dir.path().join("store.db")).expect("store file").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the store file's mode is {:o}", mode & 0o777);

    let tcp = TcpStream::connect(&addr).await.expect("connect");
    let (read, mut write) = tcp.into_split();
    let head = format!(
        "POST /v1/claims HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n"
    );
    write.write_all(head.as_bytes()).await.expect("headers");
    // `100 Continue` comes when the handler starts reading the body: the request is open.
    let mut answer = BufReader::new(read).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), answer.next_line())
        .await
        .expect("no 100 Continue within 10 s")
        .expect("read");
    assert_eq!(first.as_deref(), Some("HTTP/1.1 100 Continue"));
    write.write_all(br#"{"scope":"orders","#).await.expect("half the body");

    let pid = child.id().expect("pid").to_string();
    let sent = Instant::now();
    let kill = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
    assert!(kill.success(), "kill -TERM failed");
    let status = tokio::time::timeout(Duration::from_secs(6), child.wait())
        .await
        .expect("idem serve still running 6 s after SIGTERM (drain bound: 1 s)")
        .expect("wait");
    let took = sent.elapsed();
    assert!(status.success(), "idem serve exited with {status}");
    assert!(took >= Duration::from_millis(900), "exited after {took:?}: the request got no drain");
    drop(write);
}
