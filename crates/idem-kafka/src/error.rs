//! What can go wrong setting up or running a Kafka consumer.

use idem_core::retention::RetentionTooShort;
use rdkafka::error::KafkaError;

/// Errors of the Kafka source. Per-message failures are not errors: they end in a commit, a
/// retry or a dead letter, and are counted in the consumer's
/// [`Report`](idem_core::consumer::Report).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A client setting contradicts what the adapter needs.
    #[error("Kafka setting `{key}` = `{value}` is not allowed: {why}")]
    Setting {
        /// The librdkafka property.
        key: &'static str,
        /// The value given.
        value: String,
        /// Why idem needs it otherwise.
        why: &'static str,
    },
    /// A required client setting is missing.
    #[error("Kafka setting `{key}` is required: {why}")]
    MissingSetting {
        /// The librdkafka property.
        key: &'static str,
        /// What it is for.
        why: &'static str,
    },
    /// No topic to consume, or an empty topic name.
    #[error("topics: {0}")]
    Topics(&'static str),
    /// The consumer would read its own dead letters: the dead-letter topic is subscribed, by
    /// name or by a pattern that matches it.
    #[error(
        "the dead-letter topic `{dead_letter}` is consumed too (the subscription's \
         `{subscription}` takes it): every dead letter would come back to this consumer as a \
         new message and be processed; dead-letter to a topic the subscription does not take"
    )]
    DeadLetterLoop {
        /// The dead-letter topic.
        dead_letter: String,
        /// The topic name or pattern of the subscription that takes it.
        subscription: String,
    },
    /// A subscription pattern (`^…`) could not be read, so whether it takes the dead-letter
    /// topic is unknown.
    #[error("cannot read the topic pattern `{pattern}` to check it against the dead-letter topic")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// The parser's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The consumed topics keep messages longer than the dedup records are kept, by the
    /// window stated with [`KafkaConfig::redelivery_window`](crate::KafkaConfig::redelivery_window)
    /// (the topics' retention counts as the window's message TTL).
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
    /// The source was closed (its run ended); build a new consumer.
    #[error("the Kafka consumer is closed")]
    Closed,
    /// The brokers answered something the adapter cannot use.
    #[error("Kafka brokers: {0}")]
    Broker(String),
    /// A client call failed (create, subscribe, poll).
    #[error("Kafka {op} failed")]
    Kafka {
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: KafkaError,
    },
}

impl Error {
    pub(crate) fn kafka(op: &'static str, source: KafkaError) -> Self {
        Self::Kafka { op, source }
    }
}
