//! Errors of the adapter.

use idem_core::consumer::ConfigError;
use idem_core::retention::RetentionTooShort;

/// What stops the adapter. Per-message failures are never errors: they are outcomes mapped
/// to broker verbs. An error means the adapter cannot go on (the connection or channel is
/// gone); every message it had not acked is redelivered by the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The consumer's retention is shorter than the broker's redelivery window.
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
    /// Invalid adapter configuration.
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// Invalid engine configuration.
    #[error(transparent)]
    Engine(#[from] ConfigError),
    /// Declaring or checking a queue or exchange failed.
    #[error("declaring the {what} failed")]
    Topology {
        /// Which part of the topology.
        what: &'static str,
        /// The broker's answer.
        #[source]
        source: lapin::Error,
    },
    /// Setting up the channels (open, qos, confirms, consume) failed.
    #[error("setting up the channel failed ({what})")]
    Setup {
        /// Which step.
        what: &'static str,
        /// The broker's answer.
        #[source]
        source: lapin::Error,
    },
    /// The delivery stream failed (connection or channel lost).
    #[error("the delivery stream failed; unacked messages will be redelivered")]
    Stream(#[source] lapin::Error),
    /// An ack, nack or reject could not be sent: the channel is gone and the broker will
    /// redeliver the message.
    #[error("could not {verb} delivery {tag}; the broker will redeliver it")]
    Settle {
        /// `ack` or `nack`.
        verb: &'static str,
        /// The delivery tag.
        tag: u64,
        /// The cause, when lapin gave one (none: the channel was already closed).
        #[source]
        source: Option<lapin::Error>,
    },
    /// A broker verb (ack, nack, a dead-letter or delay publish and its confirm) did not finish
    /// within the consumer's `broker_timeout`, or the channel stopped being connected while
    /// the consumer waited for deliveries: the connection is taken for lost, and every
    /// message not acked is redelivered by the broker.
    #[error("the broker connection looks lost: {what} did not finish within {timeout:?}")]
    BrokerTimeout {
        /// What was waited for.
        what: &'static str,
        /// The limit (`AmqpConsumerBuilder::broker_timeout`).
        timeout: std::time::Duration,
    },
    /// The broker cancelled the consumer (queue deleted, node down).
    #[error("the broker cancelled the consumer")]
    Cancelled,
}
