//! What can go wrong setting up or running a JetStream consumer.

use std::time::Duration;

use idem_core::retention::RetentionTooShort;

/// Errors of the JetStream source. Per-message failures are not errors: they end in a verb
/// (ack, nak, dead-letter) and are counted in the consumer's
/// [`Report`](idem_core::consumer::Report).
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
    /// consumer counts a failed fetch and pulls again.
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
    /// The stream has no `max_age`, so a copy of a message may wait in it for ever before its
    /// first delivery, and no dedup retention covers the redelivery window.
    #[error(
        "stream `{stream}` has no max_age: a copy of a message (a producer's late retry) may wait \
         in it longer than any dedup retention, and would then run again; set the stream's \
         max_age, or state the longest a message may wait with JetStreamConfig::assume_max_age(..)"
    )]
    UnboundedMaxAge {
        /// The consumed stream.
        stream: String,
    },
    /// The dead-letter subject cannot be published to as it is.
    #[error("the dead-letter subject `{subject}` {problem}")]
    DeadLetterSubject {
        /// The subject.
        subject: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The consumer would receive its own dead letters: the consumed stream captures the
    /// dead-letter subject and the consumer's filter does not exclude it. Each dead letter would
    /// come back as a new message (a new `Nats-Msg-Id`) and be processed.
    #[error(
        "dead letters published to `{subject}` would come back to consumer `{consumer}` of \
         stream `{stream}` ({how}), to be processed as new messages; dead-letter to a subject \
         outside the stream (such as `dlq.<name>`, captured by a stream of its own), or give \
         the consumer a filter subject that excludes it"
    )]
    DeadLetterLoop {
        /// The dead-letter subject.
        subject: String,
        /// The consumed stream.
        stream: String,
        /// The consumer.
        consumer: String,
        /// How the subject reaches the consumer.
        how: String,
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
