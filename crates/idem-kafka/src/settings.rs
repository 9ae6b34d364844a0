//! Adapter settings shared by the two-phase and the inbox modes.

use std::time::Duration;

/// How the adapter batches, retries and dead-letters. Only the dead-letter topic is required.
///
/// Defaults: batches of up to 100 messages, gathered for at most 5 ms once a first one arrived;
/// wait up to 500 ms for a first message; retry transient failures after 1 s; wait up to 30 s
/// for the broker to acknowledge a dead-letter produce.
///
/// ```
/// use std::time::Duration;
/// use idem_kafka::Settings;
///
/// let s = Settings::new("orders.dlq").batch(200).retry_delay(Duration::from_secs(5));
/// assert_eq!(s.dead_letter_topic(), "orders.dlq");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Settings {
    pub(crate) dead_letter: String,
    pub(crate) batch: usize,
    pub(crate) batch_wait: Duration,
    pub(crate) idle_wait: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) produce_timeout: Duration,
}

impl Settings {
    /// Settings that dead-letter to `topic`.
    pub fn new(dead_letter_topic: impl Into<String>) -> Self {
        Self {
            dead_letter: dead_letter_topic.into(),
            batch: 100,
            batch_wait: Duration::from_millis(5),
            idle_wait: Duration::from_millis(500),
            retry_delay: Duration::from_secs(1),
            produce_timeout: Duration::from_secs(30),
        }
    }

    /// The dead-letter topic.
    pub fn dead_letter_topic(&self) -> &str {
        &self.dead_letter
    }

    /// Most messages polled (and claimed) together. At least 1.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long to keep gathering a batch after its first message arrived.
    pub fn batch_wait(mut self, d: Duration) -> Self {
        self.batch_wait = d;
        self
    }

    /// How long one poll waits for a first message.
    pub fn idle_wait(mut self, d: Duration) -> Self {
        self.idle_wait = d;
        self
    }

    /// The delay before a transiently failed message is tried again (its partition is paused
    /// meanwhile, and no offset is committed past it).
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// How long to wait for the broker to acknowledge a dead-letter produce before the message
    /// is retried instead.
    pub fn produce_timeout(mut self, d: Duration) -> Self {
        self.produce_timeout = d;
        self
    }
}
