//! Real servers for integration tests.
//!
//! Each test reads its server's address from an environment variable with a loopback default.
//! When the server does not answer, [`require`] prints `skipped: <service> unreachable at
//! <addr>` and returns `None` — unless `CI=true`, where it panics: a suite that passes without
//! its server is a defect.
//!
//! A server that `.ci/services.sh` is still bringing up in the background (tansu, built from
//! source on a new machine) has a file named after its address in `$CI_STATE_DIR/starting/`
//! (default `/tmp/idem-ci/starting/`): [`require`] waits for such an address to answer, saying
//! so once a minute, and fails at once with the build's log when the start failed.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The URL for `service` from `env_var` (or `default`), if its server answers on TCP.
///
/// # Panics
/// When the server is unreachable and the environment has `CI=true`.
pub fn require(service: &str, env_var: &str, default: &str) -> Option<String> {
    let url = std::env::var(env_var).unwrap_or_else(|_| default.to_owned());
    if reachable(&url) || wait_while_starting(service, &host_port(&url)) {
        return Some(url);
    }
    let addr = host_port(&url);
    if in_ci() {
        panic!(
            "{service} unreachable at {addr} (from {env_var}) and CI=true: failing instead of skipping"
        );
    }
    eprintln!("skipped: {service} unreachable at {addr}");
    None
}

/// [`require`] for a NATS server with JetStream, which it first gives a stream kept for good
/// (`IDEM_TEST_ANCHOR`, once per process and address), so that tests can create and delete
/// their own streams at the same time.
///
/// Why: nats-server (2.9.10 here, and its main branch still) removes an account's `streams`
/// directory when a stream's deletion leaves it empty, and a stream created at that moment fails
/// with "error creating store for stream" (its log: `mkdir …/$G/streams: no such file or
/// directory`). With one stream that is never deleted, the directory is never empty
/// (docs/TESTING.md, flake 9). A server that refuses the anchor is used as it is, with a warning.
///
/// # Panics
/// As [`require`].
pub fn require_nats(env_var: &str, default: &str) -> Option<String> {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static ANCHORED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let url = require("NATS", env_var, default)?;
    let addr = host_port(&url);
    let mut anchored =
        ANCHORED.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    if anchored.insert(addr.clone())
        && let Err(e) = keep_jetstream_account_dir(&addr)
    {
        eprintln!("warning: NATS at {addr}: could not create the anchor stream: {e}");
    }
    Some(url)
}

/// Creates the file stream `IDEM_TEST_ANCHOR` (subject `_idem_test_anchor`, at most one message)
/// at `addr` over the plain NATS protocol, unless it exists with this configuration.
fn keep_jetstream_account_dir(addr: &str) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, Error, Read, Write};
    const INBOX: &str = "_INBOX.idem_test_anchor";
    const CONFIG: &str = r#"{"name":"IDEM_TEST_ANCHOR","subjects":["_idem_test_anchor"],"storage":"file","max_msgs":1,"num_replicas":1}"#;
    let sa = addr.to_socket_addrs()?.next().ok_or_else(|| Error::other("no address"))?;
    let conn = TcpStream::connect_timeout(&sa, Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = conn.try_clone()?;
    let mut input = BufReader::new(conn);
    let mut line = String::new();
    input.read_line(&mut line)?; // the server's INFO
    write!(
        out,
        "CONNECT {{\"verbose\":false,\"pedantic\":false}}\r\nSUB {INBOX} 1\r\n\
         PUB $JS.API.STREAM.CREATE.IDEM_TEST_ANCHOR {INBOX} {}\r\n{CONFIG}\r\n",
        CONFIG.len()
    )?;
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Err(Error::other("the server closed the connection"));
        }
        if line.starts_with("PING") {
            out.write_all(b"PONG\r\n")?;
        } else if line.starts_with("-ERR") {
            return Err(Error::other(line.trim().to_owned()));
        } else if line.starts_with("MSG ") {
            let size: usize = line
                .split_whitespace()
                .last()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| Error::other(format!("bad MSG line {line:?}")))?;
            let mut reply = vec![0; size + 2];
            input.read_exact(&mut reply)?;
            let reply = String::from_utf8_lossy(&reply[..size]).into_owned();
            return match reply.contains("\"error\"") {
                true => Err(Error::other(reply)),
                false => Ok(()),
            };
        }
    }
}

/// [`require`] for a comma-separated list of URLs (the nodes of a cluster): every one must
/// answer, and there must be at least `min` of them (a list too short is a setup error, named).
///
/// # Panics
/// When the list has fewer than `min` URLs, or a node is unreachable under `CI=true`.
pub fn require_all(service: &str, env_var: &str, default: &str, min: usize) -> Option<Vec<String>> {
    let list = std::env::var(env_var).unwrap_or_else(|_| default.to_owned());
    let urls: Vec<String> =
        list.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_owned).collect();
    assert!(urls.len() >= min, "{env_var}={list:?}: expected at least {min} comma-separated URLs");
    for url in &urls {
        if !reachable(url) && !wait_while_starting(service, &host_port(url)) {
            let addr = host_port(url);
            assert!(
                !in_ci(),
                "{service} unreachable at {addr} (from {env_var}) and CI=true: failing instead of skipping"
            );
            eprintln!("skipped: {service} unreachable at {addr}");
            return None;
        }
    }
    Some(urls)
}

/// How long a test waits for a server `.ci/services.sh` is still starting: a cold tansu build
/// on two busy cores, with room to spare.
const STARTING_LIMIT: Duration = Duration::from_secs(60 * 60);

/// If `.ci/services.sh` is starting the server at `addr` in the background, waits until it
/// answers (`true`) or its start is over without it (`false`).
///
/// # Panics
/// When the background start failed (its `.failed` file holds the reason and the log's tail),
/// or the server still does not answer after [`STARTING_LIMIT`].
fn wait_while_starting(service: &str, addr: &str) -> bool {
    let dir = std::path::PathBuf::from(
        std::env::var("CI_STATE_DIR").unwrap_or_else(|_| "/tmp/idem-ci".to_owned()),
    )
    .join("starting");
    let (marker, failed) = (dir.join(addr), dir.join(format!("{addr}.failed")));
    let started = std::time::Instant::now();
    let mut said = None;
    loop {
        if let Ok(why) = std::fs::read_to_string(&failed) {
            panic!("{service} at {addr} could not be started by .ci/services.sh:\n{why}");
        }
        let Ok(what) = std::fs::read_to_string(&marker) else {
            return reachable(addr);
        };
        if reachable(addr) {
            return true;
        }
        let waited = started.elapsed();
        assert!(
            waited < STARTING_LIMIT,
            "{service} at {addr} still not up after {waited:?}: {}",
            what.trim()
        );
        let minute = waited.as_secs() / 60;
        if said != Some(minute) {
            eprintln!(
                "waiting for {service} at {addr} ({}s so far): {}",
                waited.as_secs(),
                what.trim()
            );
            said = Some(minute);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Whether `url`'s host and port accept a TCP connection within 2 s.
fn reachable(url: &str) -> bool {
    host_port(url)
        .to_socket_addrs()
        .ok()
        .and_then(|mut it| it.next())
        .is_some_and(|sa| TcpStream::connect_timeout(&sa, Duration::from_secs(2)).is_ok())
}

/// Whether the environment says this is a CI run.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `host:port` of a URL such as `postgres://user@127.0.0.1:5432/db` or a bare `127.0.0.1:4222`.
pub fn host_port(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        return host.to_owned();
    }
    let port = match scheme {
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        "redis" => 6379,
        "amqp" => 5672,
        "nats" => 4222,
        _ => 80,
    };
    format!("{host}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses() {
        assert_eq!(host_port("postgres://postgres@127.0.0.1:5432/test"), "127.0.0.1:5432");
        assert_eq!(host_port("redis://127.0.0.1/"), "127.0.0.1:6379");
        assert_eq!(host_port("amqp://guest:guest@127.0.0.1:5672/%2f"), "127.0.0.1:5672");
        assert_eq!(host_port("127.0.0.1:4222"), "127.0.0.1:4222");
    }
}
