//! What a broker offers the relay.

use std::error::Error as StdError;
use std::future::Future;

use super::OutboxMessage;

/// A failed publish: the broker refused the message, did not confirm it in time, or the
/// connection failed.
#[derive(Debug, thiserror::Error)]
#[error("publishing to {destination} failed")]
pub struct PublishError {
    destination: String,
    retryable: bool,
    #[source]
    source: Box<dyn StdError + Send + Sync>,
}

impl PublishError {
    /// A failure publishing to `destination`; `retryable` when trying again may succeed (a
    /// timeout, a lost connection, a nack), not when the message can never be published (too
    /// large for the broker, no such stream).
    pub fn new(
        destination: impl Into<String>,
        retryable: bool,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self { destination: destination.into(), retryable, source: source.into() }
    }

    /// Whether trying again may succeed.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The destination.
    pub fn destination(&self) -> &str {
        &self.destination
    }
}

/// Publishes outbox messages to one broker, each with its [`OutboxId`](super::OutboxId) where
/// the broker's consumers read a message id, and waits for the broker to confirm them.
///
/// # Contract
/// - `Ok(())` for a message only once the broker has confirmed it durably (publisher confirms,
///   a JetStream ack, an acknowledged Kafka produce, an `XADD` reply): the relay then marks it
///   sent, and never publishes it again.
/// - The id reaches the consumer where the matching idem source reads it by default, so a
///   message published twice (a relay crashed before marking it) is a duplicate downstream.
/// - One result per message, in input order. Messages of one batch may be published
///   concurrently: the relay never puts two messages of one ordering key in a batch.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `batch` and waits for each confirmation.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped call may have published some messages; they are published
    /// again after their lease, and deduplicated downstream by their id.
    fn publish(
        &self,
        batch: &[OutboxMessage],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send;
}
