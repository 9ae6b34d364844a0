//! Stopping on SIGTERM or Ctrl-C (SIGINT).

use std::future::Future;

use anyhow::Context as _;

/// Installs the SIGTERM and SIGINT handlers **now** and returns a future that ends on the first
/// of them.
///
/// Call it before telling anyone the process is ready (the `listening on` line): the handlers
/// are installed by this call, not by the first poll of the future, so a signal that arrives in
/// between is kept for the future instead of killing the process by the default action. An
/// `async fn` that called `signal()` inside left that window open, and a busy CI machine hit it
/// (`idem serve` exited by signal 15 with a request open, instead of draining it).
pub(crate) fn shutdown() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A SIGTERM that arrives after `shutdown()` returned but before its future is first polled
    /// ends the future; it does not kill the process (which would fail this whole test binary).
    #[tokio::test]
    async fn a_signal_before_the_first_poll_is_kept() {
        let stop = super::shutdown().expect("handlers");
        let pid = std::process::id().to_string();
        let kill = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
        assert!(kill.success(), "kill -TERM failed");
        tokio::time::timeout(Duration::from_secs(10), stop)
            .await
            .expect("the SIGTERM sent before the first poll was not seen within 10 s");
    }
}
