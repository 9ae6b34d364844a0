//! Adapter settings shared by the two-phase and the inbox modes.

use std::time::Duration;

/// How the adapter fetches, retries and dead-letters. Only the dead-letter subject is required.
///
/// Defaults: batches of 64, wait up to 1 s for a first message, retry transient failures after
/// 1 s, no dead-letter allowance in the retention check, no progress heartbeat of its own (the
/// two-phase mode then uses the dedup consumer's lease heartbeat).
///
/// ```
/// use std::time::Duration;
/// use idem_nats::Settings;
///
/// let s = Settings::new("orders.dlq").batch(128).retry_delay(Duration::from_secs(5));
/// assert_eq!(s.dead_letter_subject(), "orders.dlq");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Settings {
    pub(crate) dead_letter: String,
    pub(crate) batch: usize,
    pub(crate) idle_wait: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) progress: Option<Duration>,
    pub(crate) dead_letter_allowance: Duration,
}

impl Settings {
    /// Settings that dead-letter to `subject` (a stream must capture it; checked at startup).
    pub fn new(dead_letter_subject: impl Into<String>) -> Self {
        Self {
            dead_letter: dead_letter_subject.into(),
            batch: 64,
            idle_wait: Duration::from_secs(1),
            retry_delay: Duration::from_secs(1),
            progress: None,
            dead_letter_allowance: Duration::ZERO,
        }
    }

    /// The dead-letter subject.
    pub fn dead_letter_subject(&self) -> &str {
        &self.dead_letter
    }

    /// Most messages fetched (and claimed) together. At least 1.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long one pull waits for a first message when the consumer has none pending.
    pub fn idle_wait(mut self, d: Duration) -> Self {
        self.idle_wait = d;
        self
    }

    /// The `Nak` delay after a transient failure.
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// Sends `Progress` (`+WPI`) for every message of a batch every `interval` while its
    /// handlers run, so JetStream restarts their `ack_wait` instead of redelivering them.
    /// Must be shorter than `ack_wait`.
    pub fn progress(mut self, interval: Duration) -> Self {
        self.progress = Some(interval);
        self
    }

    /// How long a dead-lettered message may wait before an operator resubmits it; added to the
    /// redelivery window the retention must cover.
    pub fn dead_letter_allowance(mut self, d: Duration) -> Self {
        self.dead_letter_allowance = d;
        self
    }
}
