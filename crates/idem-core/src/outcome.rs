//! What became of a delivery.

use std::fmt;
use std::time::Duration;

use crate::extract::ExtractError;
use crate::{DedupKey, Fingerprint, KeyError, RecordState, StoreError};

/// How every delivery ends: exactly one of these.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "an outcome decides whether the message is acked, retried or dead-lettered"]
pub enum Outcome<T, E> {
    /// The handler ran and its completion is recorded: ack.
    Processed(T),
    /// Already done: ack without running the handler. Carries the stored result, if one was
    /// stored (inbox markers and oversized results carry none).
    Duplicate(Option<T>),
    /// Same key, different payload: dead-letter and alert, never drop silently.
    Conflict(Box<Conflict>),
    /// Another consumer holds a live lease: do not ack now; let the message come back after
    /// `retry_after`.
    InProgressElsewhere {
        /// Time left on the other consumer's lease.
        retry_after: Duration,
    },
    /// The delivery failed; [`Failure::kind`] says whether to retry or dead-letter.
    Failed(Failure<E>),
}

/// Which outcome a delivery had, without its data: what logs, metrics, reports and dead-letter
/// headers name.
///
/// ```
/// use idem_core::engine::OutcomeKind;
///
/// assert_eq!(OutcomeKind::InProgressElsewhere.as_str(), "in_progress_elsewhere");
/// assert_eq!(OutcomeKind::ALL.len(), 6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OutcomeKind {
    /// The handler ran and its effect is committed.
    Processed,
    /// Already done.
    Duplicate,
    /// Same key, different payload.
    Conflict,
    /// Another consumer holds the key's lease.
    InProgressElsewhere,
    /// Failed; a retry may help.
    FailedTransient,
    /// Failed; a retry will not help.
    FailedPermanent,
}

impl OutcomeKind {
    /// Every kind, in declaration order.
    pub const ALL: [Self; 6] = [
        Self::Processed,
        Self::Duplicate,
        Self::Conflict,
        Self::InProgressElsewhere,
        Self::FailedTransient,
        Self::FailedPermanent,
    ];

    /// The label: `processed`, `duplicate`, `conflict`, `in_progress_elsewhere`,
    /// `failed_transient`, `failed_permanent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::InProgressElsewhere => "in_progress_elsewhere",
            Self::FailedTransient => "failed_transient",
            Self::FailedPermanent => "failed_permanent",
        }
    }
}

impl fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Details of a conflicting reuse of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The reused key.
    pub key: DedupKey,
    /// Fingerprint stored by the first message with this key.
    pub stored: Option<Fingerprint>,
    /// Fingerprint of this delivery.
    pub incoming: Option<Fingerprint>,
    /// State of the stored record.
    pub stored_state: RecordState,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = |fp: Option<Fingerprint>| {
            fp.map_or_else(|| "none".to_owned(), |f| f.to_string()[..16].to_owned())
        };
        write!(
            f,
            "key {} reused with a different payload (stored fingerprint {}…, {}; this one {}…)",
            self.key,
            short(self.stored),
            self.stored_state,
            short(self.incoming)
        )
    }
}

/// Whether retrying can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Release the claim and let the broker redeliver.
    Transient,
    /// Dead-letter the message; the record is kept as failed.
    Permanent,
}

/// A failed delivery: its kind and its cause, keeping the handler's own error type.
#[derive(Debug)]
pub struct Failure<E> {
    /// Retry or dead-letter.
    pub kind: FailureKind,
    /// What went wrong.
    pub cause: Cause<E>,
}

/// What made a delivery fail.
#[derive(Debug)]
#[non_exhaustive]
pub enum Cause<E> {
    /// The handler's error.
    Handler(E),
    /// The message carries no key and the policy is to reject such messages.
    MissingKey(ExtractError),
    /// The key found is malformed (empty, too long, NUL).
    InvalidKey(KeyError),
    /// The key could not be read (wrong type, not JSON).
    Extract(ExtractError),
    /// The fingerprint needs a JSON payload and this one is not JSON.
    Payload(serde_json::Error),
    /// An earlier attempt's lease ran out and the consumer parks such messages (the effect may
    /// have happened); an operator must release the key to run it again.
    InDoubt {
        /// The attempt that found the expired lease.
        attempt: u32,
    },
    /// The key's holders kept dying while it ran (each one's lease ran out without an outcome:
    /// the process died, or stalled past its lease): it reached the crash-loop limit and is
    /// dead-lettered without running the handler again. The record is failed, so a
    /// resubmission runs again.
    CrashLoop {
        /// The holders that died running it ([`Lease::deaths`](crate::Lease::deaths)).
        deaths: u32,
        /// The configured limit.
        limit: u32,
    },
    /// The store failed. When this follows a successful handler, the effect happened but its
    /// completion was not recorded: the next delivery runs the handler again with the same
    /// downstream idempotency key.
    Store(StoreError),
    /// The stored result does not decode as this handler's result type.
    Decode(serde_json::Error),
}

impl<E: fmt::Display> fmt::Display for Cause<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "handler failed: {e}"),
            Self::MissingKey(e) => write!(f, "{e}"),
            Self::InvalidKey(e) => write!(f, "invalid dedup key: {e}"),
            Self::Extract(e) => write!(f, "{e}"),
            Self::Payload(e) => write!(f, "payload is not JSON: {e}"),
            Self::InDoubt { attempt } => write!(
                f,
                "in doubt: the lease of an earlier attempt ran out (found at attempt {attempt}); \
                 the effect may have happened, so the message is parked until an operator releases it"
            ),
            Self::CrashLoop { deaths, limit } => write!(
                f,
                "crash loop: {deaths} deaths: each holder's lease ran out while its handler ran \
                 (the process died, or stalled past its lease); limit {limit}, not run again"
            ),
            Self::Store(e) => write!(f, "{}", crate::ErrorChain(e)),
            Self::Decode(e) => write!(f, "stored result does not decode: {e}"),
        }
    }
}

/// What the broker is told about a delivery: the one verb enum, from an outcome to the source.
///
/// [`Outcome::verb`] answers `Ack`, `Retry` or `DeadLetter`; a consumer hands a source
/// `DeadLetter` only once the dead-letter copy is confirmed (the source then removes the
/// original), and `Release` for a message fetched while shutting down.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verb {
    /// Acknowledge: the effect is committed (or was already).
    Ack,
    /// Do not ack; redeliver, after `after` where the broker can delay.
    Retry {
        /// Suggested delay (the other lease's remaining time).
        after: Option<Duration>,
    },
    /// Dead-letter with this reason: copy it to the dead-letter destination, then remove the
    /// original (ack, term, commit). A source receives it once the copy is confirmed.
    DeadLetter {
        /// Why, for the dead-letter headers.
        reason: String,
    },
    /// Give it back untouched (fetched while the consumer was shutting down).
    Release,
}

impl<T, E: fmt::Display> Outcome<T, E> {
    /// The broker verb this outcome calls for: `Ack`, `Retry` or `DeadLetter`.
    pub fn verb(&self) -> Verb {
        match self {
            Self::Processed(_) | Self::Duplicate(_) => Verb::Ack,
            Self::Conflict(c) => Verb::DeadLetter { reason: format!("conflict: {c}") },
            Self::InProgressElsewhere { retry_after } => Verb::Retry { after: Some(*retry_after) },
            Self::Failed(f) => match f.kind {
                FailureKind::Transient => Verb::Retry { after: None },
                FailureKind::Permanent => Verb::DeadLetter { reason: f.cause.to_string() },
            },
        }
    }
}

impl<T, E> Outcome<T, E> {
    /// Which of the six outcomes this is: the label of logs, metrics and reports.
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Self::Processed(_) => OutcomeKind::Processed,
            Self::Duplicate(_) => OutcomeKind::Duplicate,
            Self::Conflict(_) => OutcomeKind::Conflict,
            Self::InProgressElsewhere { .. } => OutcomeKind::InProgressElsewhere,
            Self::Failed(Failure { kind: FailureKind::Transient, .. }) => {
                OutcomeKind::FailedTransient
            }
            Self::Failed(Failure { kind: FailureKind::Permanent, .. }) => {
                OutcomeKind::FailedPermanent
            }
        }
    }

    /// A failure of `kind` with `cause`.
    pub fn failed(kind: FailureKind, cause: Cause<E>) -> Self {
        Self::Failed(Failure { kind, cause })
    }

    /// A store failure a retry may clear.
    pub(crate) fn transient(e: StoreError) -> Self {
        Self::failed(FailureKind::Transient, Cause::Store(e))
    }

    /// The failure a handler's error calls for: transient (retry) or permanent (dead-letter).
    pub(crate) fn from_handler_error(e: HandlerError<E>) -> Self {
        match e {
            HandlerError::Transient(e) => Self::failed(FailureKind::Transient, Cause::Handler(e)),
            HandlerError::Permanent(e) => Self::failed(FailureKind::Permanent, Cause::Handler(e)),
        }
    }
}

/// A handler's error, classified: a transient one releases the claim for a retry, a permanent one
/// dead-letters the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerError<E> {
    /// Retrying may help (a timeout, a 503).
    Transient(E),
    /// Retrying will not help (a validation error).
    Permanent(E),
}

impl<E> HandlerError<E> {
    /// A transient failure from any error that converts into the handler's error type: with
    /// `E = Box<dyn Error + Send + Sync>`, `.map_err(HandlerError::transient)?` takes a database
    /// error and an outbox error alike.
    ///
    /// ```
    /// use idem_core::engine::HandlerError;
    /// type BoxError = Box<dyn std::error::Error + Send + Sync>;
    ///
    /// fn parse(s: &str) -> Result<u32, HandlerError<BoxError>> {
    ///     let n: u32 = s.parse().map_err(HandlerError::permanent)?; // retrying will not help
    ///     Ok(n)
    /// }
    /// assert!(matches!(parse("x"), Err(HandlerError::Permanent(_))));
    /// ```
    pub fn transient(e: impl Into<E>) -> Self {
        Self::Transient(e.into())
    }

    /// A permanent failure (dead-lettered) from any error that converts into `E`.
    pub fn permanent(e: impl Into<E>) -> Self {
        Self::Permanent(e.into())
    }
}
