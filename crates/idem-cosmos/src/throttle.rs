//! 429 handling: wait what the service asks (`x-ms-retry-after-ms`), a bounded number of times.

use std::future::Future;
use std::time::Duration;

use azure_data_cosmos::CosmosError;

use crate::Error;

/// How a throttled (429) request is retried, on top of the retries the SDK itself makes.
///
/// Each retry waits the `x-ms-retry-after-ms` the service sent (100 ms when it sent none),
/// capped at `max_wait`. After `attempts` tries the operation fails with
/// [`Error::Throttled`], which is retryable: a consumer releases the message for redelivery.
///
/// # The SDK's own retries come first
/// `azure_data_cosmos` 1.1.0-beta.1 retries a 429 on an item request (read, create, replace,
/// delete, batch, query page) by itself, **18 times** by default (19 requests), each time
/// waiting the `x-ms-retry-after-ms` capped at 15 s, 270 s in all; only then does this policy
/// see the 429. So each of its tries is up to 19 requests, and with the defaults one
/// operation can make 3 × 19 requests and wait minutes. (The SDK documents "default 9" on
/// `ThrottlingRetryOptions::max_retry_count`; that is its budget for metadata requests.)
/// To leave throttling to this policy alone, set the SDK's count to 0 on the client (or
/// `AZURE_COSMOS_MAX_THROTTLE_RETRY_COUNT=0`, which options set in code override):
///
/// ```
/// use azure_data_cosmos::options::{OperationOptionsBuilder, ThrottlingRetryOptionsBuilder};
///
/// let no_sdk_throttle_retries = OperationOptionsBuilder::new()
///     .with_throttling_retry_options(
///         ThrottlingRetryOptionsBuilder::new().with_max_retry_count(0).build(),
///     )
///     .build();
/// let builder = azure_data_cosmos::CosmosClientBuilder::new()
///     .with_default_operation_options(no_sdk_throttle_retries);
/// # drop(builder);
/// ```
///
/// Both layers' waits are tokio timers. `tests/it/emulator_throttling.rs` pins these numbers
/// down against the SDK's fault injection.
///
/// ```
/// use std::time::Duration;
/// let policy = idem_cosmos::ThrottlePolicy::new(5).max_wait(Duration::from_secs(2));
/// assert_eq!(policy.attempts(), 5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottlePolicy {
    attempts: u32,
    max_wait: Duration,
    fallback: Duration,
}

impl Default for ThrottlePolicy {
    /// 3 tries, waits capped at 5 s, 100 ms when the service names no wait.
    fn default() -> Self {
        Self { attempts: 3, max_wait: Duration::from_secs(5), fallback: Duration::from_millis(100) }
    }
}

impl ThrottlePolicy {
    /// `attempts` tries in all (at least 1), with the default waits.
    pub fn new(attempts: u32) -> Self {
        Self { attempts: attempts.max(1), ..Self::default() }
    }

    /// Caps each wait at `max_wait`, whatever the service asks.
    #[must_use]
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// Tries in all.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Runs `f` until it does not answer 429, or the tries are spent (then the last 429).
    pub(crate) async fn run<T, F, Fut>(&self, mut f: F) -> Result<T, CosmosError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, CosmosError>>,
    {
        let mut tried = 1;
        loop {
            match f().await {
                Err(e) if e.status().is_throttled() && tried < self.attempts => {
                    let wait = retry_after(&e).unwrap_or(self.fallback).min(self.max_wait);
                    tracing::debug!(target: "idem", ?wait, tried, "Cosmos DB throttled (429); waiting");
                    tokio::time::sleep(wait).await;
                    tried += 1;
                }
                other => return other,
            }
        }
    }

    /// The error for a failed `op`: [`Error::Throttled`] for a 429 (our tries are spent),
    /// [`Error::Cosmos`] otherwise.
    pub(crate) fn fail(&self, op: &'static str, e: CosmosError) -> Error {
        if e.status().is_throttled() {
            Error::Throttled {
                op,
                attempts: self.attempts,
                retry_after: retry_after(&e),
                source: e,
            }
        } else {
            Error::cosmos(op, e)
        }
    }
}

/// The `x-ms-retry-after-ms` of a 429.
fn retry_after(e: &CosmosError) -> Option<Duration> {
    e.response().and_then(|r| r.headers().retry_after_ms).map(Duration::from_millis)
}
