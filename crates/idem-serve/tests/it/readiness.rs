//! `/readyz` follows the store: on Redis (a server of the test's own, stalled with SIGSTOP,
//! resumed, killed and started again) it answers 503 within its 2 s bound while the server does
//! not answer, and 200 once it does.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` on a free loopback port, without persistence, killed on drop.
struct OwnRedis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl OwnRedis {
    fn start(port: u16) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--maxmemory-policy", "noeviction"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(child) => Some(Self { child, port, _dir: dir }),
            Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("redis-server cannot be started: {e}")
            }
            Err(e) => {
                eprintln!("skipped: redis-server cannot be started: {e}");
                None
            }
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([sig, &self.child.id().to_string()]).status().unwrap();
        assert!(ok.success(), "kill {sig}");
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port (bound, then let go).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// `GET /readyz`: its status, and how long it took. A 503 tells an unauthenticated caller
/// nothing of the store's error (the server's log does).
async fn readyz(http: &reqwest::Client, base: &str) -> (u16, Duration) {
    let started = Instant::now();
    let res = http.get(format!("{base}/readyz")).send().await.unwrap();
    let (status, took) = (res.status().as_u16(), started.elapsed());
    let body = res.text().await.unwrap().to_lowercase();
    for leak in ["refused", "redis", "127.0.0.1", "os error"] {
        assert!(!body.contains(leak), "/readyz shows the store's error ({leak}): {body}");
    }
    (status, took)
}

/// Asks `/readyz` until it answers `want`, for up to 20 s.
async fn until(http: &reqwest::Client, base: &str, want: u16, what: &str) {
    let waiting = format!("/readyz to answer {want} ({what})");
    idem_testkit::wait_for(&waiting, Duration::from_secs(20), || async {
        readyz(http, base).await.0 == want
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_a_stalled_stopped_and_restarted_redis() {
    let port = free_port();
    let Some(redis) = OwnRedis::start(port) else { return };
    let _ = idem_serve::tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    let store = loop {
        match idem_redis::RedisStore::connect(&redis.url()).await {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the test's redis-server never answered: {e}"),
        }
    };
    let server = common::serve(store).await;
    let (base, http) = (server.base(), reqwest::Client::new());
    assert_eq!(readyz(&http, &base).await.0, 200);

    // Stalled: the connection is up, nothing answers. Bounded by /readyz's 2 s.
    redis.signal("-STOP");
    let (status, took) = readyz(&http, &base).await;
    redis.signal("-CONT");
    assert_eq!(status, 503, "a stalled Redis is ready?");
    assert!(took < Duration::from_secs(5), "/readyz waited {took:?} on a stalled Redis");
    until(&http, &base, 200, "after SIGCONT").await;

    // Stopped: refused connections; then a new server on the same port.
    redis.stop();
    let (status, took) = readyz(&http, &base).await;
    assert_eq!(status, 503, "a stopped Redis is ready?");
    assert!(took < Duration::from_secs(5), "/readyz waited {took:?} on a stopped Redis");
    let again = OwnRedis::start(port).unwrap();
    until(&http, &base, 200, "after the restart").await;
    drop(again);
}
