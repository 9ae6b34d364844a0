//! Child processes for crash tests: the test binary runs itself again as a consumer process,
//! which the test then aborts or kills with SIGKILL (feature `source`).
//!
//! The child's entry is an `#[ignore]`d test of the same binary that reads its instructions from
//! an environment variable; [`run_child`] starts it with `--ignored --exact` and collects what
//! it prints.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncBufReadExt;

/// With `IDEM_TEST_LOG=PATH` set, sends this process's `tracing` events to `PATH.<pid>` (filter
/// `IDEM_TEST_LOG_FILTER`, default `idem=debug`), so a failing fault test leaves each of its
/// processes' story behind; without it, does nothing. Once per process (later calls, and a
/// process that already has a subscriber, keep what is there).
pub fn log_from_env() {
    use tracing_subscriber::EnvFilter;
    let Ok(path) = std::env::var("IDEM_TEST_LOG") else { return };
    let path = format!("{path}.{}", std::process::id());
    let Ok(file) = std::fs::File::create(&path) else {
        eprintln!("IDEM_TEST_LOG: cannot create {path}");
        return;
    };
    let filter = std::env::var("IDEM_TEST_LOG_FILTER").unwrap_or_else(|_| "idem=debug".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(filter))
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_thread_names(true)
        .try_init();
}

/// The name libtest gives the test `name` defined in the module `module_path` (as
/// `module_path!()` gives it: the test binary's crate name first), for [`spawn_child`] and
/// [`run_child`]: `child_entry(module_path!(), "my_child")` is `"modes::my_child"` in a module
/// `modes` of a test binary, `"my_child"` at its root.
#[must_use]
pub fn child_entry(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_owned(),
    }
}

/// Runs the test `entry` of this test binary as a child process with `env` set, until it prints
/// a line starting with `until` (then kills it with SIGKILL) or until it exits; returns the
/// lines it printed (libtest's `test … ... ` prefix removed).
///
/// `limit` bounds the silence, not the whole run: a child that goes on printing is slow, not
/// stuck, on a busy machine.
///
/// # Panics
/// When the child cannot be started, ends normally (a crash test's child must crash or be
/// killed), or goes `limit` without printing a line or ending.
///
/// # Cancel safety
/// Cancel safe: dropped, the child is killed with its handle (`kill_on_drop`).
pub async fn run_child(
    entry: &str,
    env: (&str, &str),
    until: Option<&str>,
    limit: Duration,
) -> Vec<String> {
    let mut child = spawn_child(entry, &[env]);
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    let silent = |seen: &[String]| {
        format!(
            "the child neither crashed nor printed {until:?}: silent for {limit:?} after {seen:?}"
        )
    };
    loop {
        let line = tokio::time::timeout(limit, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("{}", silent(&seen)));
        let Some(l) = line.expect("child stdout") else { break };
        // libtest prints `test … ... ` on the same line first.
        let l = l.rsplit("... ").next().unwrap_or(&l).to_owned();
        let stop = until.is_some_and(|u| l.starts_with(u));
        seen.push(l);
        if stop {
            child.kill().await.expect("kill child");
            break;
        }
    }
    let status = tokio::time::timeout(limit, child.wait())
        .await
        .unwrap_or_else(|_| panic!("{}", silent(&seen)))
        .expect("child status");
    assert!(!status.success(), "the child ended normally: {seen:?}");
    seen
}

/// Starts the test `entry` of this test binary as a child process with `env` set, its stdout
/// piped and its stdin piped: dropping the child's stdin asks it to stop ([`stdin_closed`]);
/// [`tokio::process::Child::kill`] sends SIGKILL. The child is killed if the handle is dropped.
///
/// # Panics
/// When the child cannot be started.
pub fn spawn_child(entry: &str, env: &[(&str, &str)]) -> tokio::process::Child {
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args([entry, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child")
}

/// Resolves when this process's stdin is closed: the stop signal of a [`spawn_child`] child.
///
/// # Cancel safety
/// Cancel safe: it only reads stdin.
pub async fn stdin_closed() {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
}
