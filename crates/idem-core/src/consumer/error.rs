//! Why a consumer could not be built, and what stops one that runs.

use std::time::Duration;

use crate::StoreError;
use crate::engine::ConfigError;

/// Why a consumer could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError<E: std::error::Error + 'static> {
    /// The engine's configuration is invalid. The message carries the configuration error's,
    /// which names the setting (and the limit); it is not repeated as a `source()`.
    #[error("invalid consumer configuration: {0}")]
    Config(ConfigError),
    /// The store is not ready: its table was never created (the message names the
    /// `migrate()` to run), or it cannot be reached. The message carries the store error's,
    /// and its causes; it is not repeated as a `source()`.
    #[error("the store is not ready: {}", crate::ErrorChain(.0))]
    Store(StoreError),
    /// Opening the broker source failed (connection, broker configuration checks).
    #[error("opening the broker source failed")]
    Open(#[source] E),
}

// By hand: `#[from]` would also make the configuration error the `source()`, and a report
// walking the chain would print its message twice.
impl<E: std::error::Error + 'static> From<ConfigError> for BuildError<E> {
    fn from(e: ConfigError) -> Self {
        Self::Config(e)
    }
}

/// What stops a running consumer. Per-message failures are never errors: they are outcomes,
/// mapped to broker verbs and counted in the [`Report`](super::Report). After an error every
/// message not acknowledged is redelivered by the broker, and the store makes the copies
/// duplicates.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error<E: std::error::Error + 'static> {
    /// Fetching failed and the fetch-failure policy gave up (or the error was fatal).
    #[error("fetching from the broker failed ({attempts} in a row)")]
    Fetch {
        /// Failed fetches in a row, this one included.
        attempts: u32,
        /// The last error.
        #[source]
        source: E,
    },
    /// The broker could no longer be told what became of a batch.
    #[error("settling a batch with the broker failed; unacknowledged messages will be redelivered")]
    Settle(#[source] E),
    /// A broker call did not finish within the consumer's broker timeout: the connection is
    /// taken for lost.
    #[error("the broker connection looks lost: {what} did not finish within {timeout:?}")]
    BrokerTimeout {
        /// What was waited for.
        what: &'static str,
        /// The limit.
        timeout: Duration,
    },
}
