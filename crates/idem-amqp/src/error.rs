//! Errors of the adapter.

use idem_core::retention::RetentionTooShort;

/// Errors of the RabbitMQ source. Per-message failures are not errors: they end in a verb
/// (ack, nack, a delay or dead-letter copy) and are counted in the consumer's
/// [`Report`](idem_core::consumer::Report). An error from a running consumer means its channel
/// is gone; every message it had not acked is redelivered by the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The consumer's retention is shorter than the broker's redelivery window.
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
    /// A setting is unusable (the message names it and the limit).
    #[error("invalid RabbitMQ settings: {0}")]
    Config(String),
    /// Dead letters would be routed back into the work queue and processed again as new
    /// messages (see [`Topology`](crate::Topology) for what is checked).
    #[error(
        "dead letters published to exchange `{exchange}` with routing key `{queue}` would come \
         back to the work queue `{queue}` ({how}); give the dead-letter exchange and queue \
         names of their own"
    )]
    DeadLetterLoop {
        /// The dead-letter exchange (empty: the default exchange).
        exchange: String,
        /// The work queue (also the dead letters' routing key).
        queue: String,
        /// How they would come back.
        how: String,
    },
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
    /// The consuming channel is no longer connected while the consumer waited for deliveries.
    #[error("the consuming channel is closed; unacked messages will be redelivered")]
    ChannelClosed,
    /// The broker cancelled the consumer (queue deleted, node down).
    #[error("the broker cancelled the consumer")]
    Cancelled,
    /// An ack or nack could not be sent: the channel is gone and the broker will redeliver the
    /// message.
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
    /// Publishing a dead-letter or delay copy failed; the original is not acked.
    #[error("publishing a copy to exchange `{exchange}` failed")]
    Copy {
        /// The exchange (empty: the default exchange, for the delay queue).
        exchange: String,
        /// The broker's answer.
        #[source]
        source: lapin::Error,
    },
    /// The broker did not take a dead-letter or delay copy; the original is not acked.
    #[error("the copy to exchange `{exchange}` was not stored: {why}")]
    CopyRefused {
        /// The exchange (empty: the default exchange, for the delay queue).
        exchange: String,
        /// Nacked, or returned as unroutable.
        why: &'static str,
    },
}
