//! What the AMQP 1.0 source reports.

use std::time::Duration;

use fe2o3_amqp::connection::OpenError;
use fe2o3_amqp::link::{
    DispositionError, ReceiverAttachError, RecvError, SendError, SenderAttachError,
};
use fe2o3_amqp::session::BeginError;
use idem_core::retention::RetentionTooShort;

/// An AMQP 1.0 or Service Bus failure, naming the step that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is out of range or malformed.
    #[error("invalid setting `{field}`: {reason}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Dead letters sent to the dead-letter address would come back to this consumer's source
    /// and be processed again as new messages.
    #[error(
        "dead letters sent to `{dead_letters}` would come back to the source `{address}` \
         ({how}); dead-letter to an address the source does not receive from"
    )]
    DeadLetterLoop {
        /// The source address.
        address: String,
        /// The dead-letter address.
        dead_letters: String,
        /// How they would come back.
        how: String,
    },
    /// The dedup retention is shorter than the window in which the broker may redeliver
    /// ([`Amqp10Config::redelivery_window`](crate::Amqp10Config::redelivery_window), or
    /// Service Bus' `LockDuration × MaxDeliveryCount`).
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
    /// The TCP or TLS connection could not be made.
    #[error("cannot connect to {addr}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake failed: the server's certificate is not signed by a trusted CA or
    /// does not name the host, the server does not speak TLS on that port, or it refused the
    /// client certificate.
    #[error("TLS handshake with {addr} failed")]
    Tls {
        /// `host:port`.
        addr: String,
        /// The TLS error (rustls' reason is in its message).
        #[source]
        source: std::io::Error,
    },
    /// The AMQP connection could not be opened (refused, SASL failed).
    #[error("cannot open the AMQP 1.0 connection to {addr}")]
    Open {
        /// `host:port`.
        addr: String,
        /// The client's error.
        #[source]
        source: OpenError,
    },
    /// The session could not begin.
    #[error("cannot begin an AMQP 1.0 session")]
    Begin(#[source] BeginError),
    /// The receiving link could not attach (no such queue, not allowed).
    #[error("cannot attach a receiver to `{address}`")]
    AttachReceiver {
        /// The source address.
        address: String,
        /// The client's error.
        #[source]
        source: ReceiverAttachError,
    },
    /// A sending link (dead-letter address, management node) could not attach.
    #[error("cannot attach a sender to `{address}`")]
    AttachSender {
        /// The target address.
        address: String,
        /// The client's error.
        #[source]
        source: SenderAttachError,
    },
    /// Authorisation through the claims-based-security node (`$cbs`) failed.
    #[error("claims-based authorisation for `{audience}` failed: {reason}")]
    Authorize {
        /// The audience the token was for.
        audience: String,
        /// What the broker or the token source said.
        reason: String,
    },
    /// Receiving failed; the link is unusable.
    #[error("receiving from `{address}` failed")]
    Recv {
        /// The source address.
        address: String,
        /// The client's error.
        #[source]
        source: RecvError,
    },
    /// The link's task has ended (the link or the connection is gone).
    #[error("the link to `{address}` is gone")]
    LinkGone {
        /// The source address.
        address: String,
    },
    /// A disposition (accepted, released, rejected, modified) could not be sent.
    #[error("cannot send the `{verb}` disposition")]
    Disposition {
        /// The verb.
        verb: &'static str,
        /// The client's error.
        #[source]
        source: DispositionError,
    },
    /// A dead-letter copy could not be sent.
    #[error("cannot send the dead-letter copy to `{address}`")]
    Send {
        /// The dead-letter address.
        address: String,
        /// The client's error.
        #[source]
        source: SendError,
    },
    /// The broker settled a dead-letter copy with something other than `accepted`.
    #[error("the broker did not accept the dead-letter copy sent to `{address}`: {outcome}")]
    NotAccepted {
        /// The dead-letter address.
        address: String,
        /// The outcome it answered.
        outcome: String,
    },
    /// A management request (lock renewal, scheduling) failed.
    #[error("management operation `{operation}` failed: {reason}")]
    Management {
        /// The operation.
        operation: &'static str,
        /// The status or the client's error.
        reason: String,
    },
    /// A broker call did not finish in time (a blocking verb is never awaited forever).
    #[error("`{verb}` did not finish within {after:?}")]
    Timeout {
        /// The call.
        verb: &'static str,
        /// The bound.
        after: Duration,
    },
}

impl Error {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Config { field, reason: reason.into() }
    }

    /// Whether the link or connection is gone, so the consumer cannot go on.
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Recv { .. } | Self::LinkGone { .. } | Self::Timeout { .. })
    }
}

/// Runs `fut` bounded by `after`, naming `verb` when it runs out.
pub(crate) async fn bounded<T>(
    verb: &'static str,
    after: Duration,
    fut: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(after, fut).await.map_err(|_| Error::Timeout { verb, after })?
}
