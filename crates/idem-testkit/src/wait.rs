//! Waiting on a condition in tests, never sleeping as synchronisation.

use std::future::Future;
use std::time::Duration;

/// Polls `cond` every 20 ms until it holds; panics naming `what` after `timeout`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut n = 0;
/// idem_testkit::wait_for("three polls", std::time::Duration::from_secs(1), || {
///     n += 1;
///     std::future::ready(n == 3)
/// })
/// .await;
/// # }
/// ```
///
/// # Cancel safety
/// Cancel safe: it only polls `cond`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
