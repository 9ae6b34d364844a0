//! What can go wrong setting up or running a JetStream consumer.

use std::time::Duration;

use idem_core::retention::RetentionTooShort;

/// Errors of the JetStream source. Per-message failures are not errors: they end in a verb
/// (ack, nak, dead-letter) and are counted in the driver's
/// [`Report`](idem_core::driver::Report).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pull consumer does not use explicit acks; idem needs to ack each message itself,
    /// after its effect is committed.
    #[error("consumer `{consumer}` has ack policy {policy}; idem needs AckPolicy::Explicit")]
    AckPolicy {
        /// The consumer.
        consumer: String,
        /// Its ack policy.
        policy: String,
    },
    /// `max_deliver` is unlimited, so no retention can outlast the redelivery window.
    #[error(
        "consumer `{consumer}` has no max_deliver limit: the redelivery window (ack_wait × max_deliver) is unbounded, so no dedup retention covers it; set max_deliver"
    )]
    UnboundedRedelivery {
        /// The consumer.
        consumer: String,
    },
    /// A pull request got no answer within its expiry and a grace period: the server most
    /// likely restarted and forgot it (the client reconnects, the request is not resent). The
    /// driver counts a failed fetch and pulls again.
    #[error(
        "a pull request got no answer within {0:?}: the server may have restarted; pulling again"
    )]
    PullUnanswered(Duration),
    /// The dedup retention is shorter than JetStream's redelivery window.
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
    /// The progress heartbeat is not shorter than `ack_wait`, so it cannot keep a message from
    /// being redelivered while its handler runs.
    #[error(
        "progress heartbeat {heartbeat:?} must be shorter than the consumer's ack_wait {ack_wait:?}"
    )]
    Heartbeat {
        /// The heartbeat interval.
        heartbeat: Duration,
        /// The consumer's ack wait.
        ack_wait: Duration,
    },
    /// No stream captures the dead-letter subject: dead-lettered messages would be lost.
    #[error("no JetStream stream captures the dead-letter subject `{subject}`")]
    NoDeadLetterStream {
        /// The subject.
        subject: String,
        /// The lookup error.
        #[source]
        source: async_nats::Error,
    },
    /// The server is older than the features this adapter uses (NATS 2.9).
    #[error("NATS server {version} is too old: idem-nats needs 2.9 or newer")]
    ServerTooOld {
        /// The server's version string.
        version: String,
    },
    /// A setting is unusable.
    #[error("invalid JetStream settings: {0}")]
    Config(&'static str),
    /// A JetStream API call failed (stream or consumer info, fetch).
    #[error("JetStream {op} failed")]
    JetStream {
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: async_nats::Error,
    },
}

impl Error {
    pub(crate) fn js(op: &'static str, source: impl Into<async_nats::Error>) -> Self {
        Self::JetStream { op, source: source.into() }
    }
}
