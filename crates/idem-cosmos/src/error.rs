//! Errors of the Cosmos DB store, marker and inbox, classified.

use std::time::Duration;

use azure_data_cosmos::CosmosError;
use idem_core::StoreError;

/// What went wrong talking to Cosmos DB, or before it (validation).
///
/// Outcomes (first time, duplicate, conflict) are values, never errors. Use
/// [`Error::is_retryable`] to decide between a retry and giving up; `From<Error> for
/// StoreError` keeps that classification.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A document id Cosmos DB would refuse: empty, longer than 255 characters, or containing
    /// `/`, `\`, `?` or `#`.
    #[error("document id {id:?} is invalid: {reason}")]
    InvalidId {
        /// The id as given.
        id: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A partition key value Cosmos DB would refuse: empty, or longer than 2 KiB.
    #[error("partition key value is invalid: {reason}")]
    InvalidPartitionKey {
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A partition key path or field pointer that is not `/field` (nested: `/a/b`).
    #[error("{path:?} is not a field path: it must look like /field or /a/b")]
    InvalidPath {
        /// The path as given.
        path: String,
    },
    /// A batch failed on a document that exists already (409) while the dedup marker did not:
    /// the entity was written by something other than this consumer. Nothing was committed.
    #[error(
        "document {id:?} already exists, but this key's marker does not; nothing was committed"
    )]
    Exists {
        /// The existing document's id (empty when Cosmos DB did not say which).
        id: String,
    },
    /// A transactional batch failed on one of its operations (the others answer 424), for a
    /// reason other than a 409.
    #[error("transactional batch failed: operation {index} answered {status}")]
    BatchFailed {
        /// The failing operation's HTTP status.
        status: u16,
        /// Its index in the batch (0 is the marker).
        index: usize,
    },
    /// A value is larger than Cosmos DB (or this crate, to stay under Cosmos DB's item limit)
    /// accepts.
    #[error("{field} is {len} bytes, more than the limit of {limit} bytes")]
    TooLarge {
        /// What was too large (`"document"`, `"batch"`, `"result"`).
        field: &'static str,
        /// Its size in bytes.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A transactional batch holds at most 100 operations.
    #[error("a transactional batch holds at most {limit} operations; this one has {count}")]
    TooManyOperations {
        /// Operations in the batch (marker included).
        count: usize,
        /// Cosmos DB's limit.
        limit: usize,
    },
    /// A document's partition key field does not hold the partition key it is written under.
    #[error(
        "document {id:?} has {path} = {found}, but it is written under partition key {expected:?}"
    )]
    WrongPartition {
        /// The document's id.
        id: String,
        /// The partition key path (`/orderId`).
        path: String,
        /// The partition key the write is for.
        expected: String,
        /// What the document holds there (`null` when absent).
        found: String,
    },
    /// Cosmos DB answered 429 on every try, after the SDK's own retries and ours, each waiting
    /// the `x-ms-retry-after-ms` the service asked for. Retryable.
    #[error("Cosmos DB throttled `{op}` (429) on all {attempts} tries")]
    Throttled {
        /// The operation.
        op: &'static str,
        /// How many times it was tried.
        attempts: u32,
        /// The last `x-ms-retry-after-ms`, if the service sent one.
        retry_after: Option<Duration>,
        /// The last 429.
        #[source]
        source: CosmosError,
    },
    /// Cosmos DB (or the way to it) failed.
    #[error("Cosmos DB operation `{op}` failed")]
    Cosmos {
        /// The operation (`"create_item"`, `"read_item"`, `"batch"`, …).
        op: &'static str,
        /// The SDK's error: status, sub-status and diagnostics.
        #[source]
        source: CosmosError,
    },
    /// A document does not serialize to JSON, or one read back does not decode.
    #[error("{what}")]
    Json {
        /// What failed (`"document does not serialize"`, `"stored marker does not decode"`).
        what: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// A stored document is malformed (a missing field, a bad fingerprint).
    #[error("stored document is malformed: {what}")]
    Corrupt {
        /// What did not decode.
        what: String,
    },
}

impl Error {
    pub(crate) fn cosmos(op: &'static str, source: CosmosError) -> Self {
        Self::Cosmos { op, source }
    }

    /// Whether trying again may succeed: throttling, timeouts, 410/449/5xx and failures to
    /// reach the service. Validation errors, 4xx answers and malformed documents are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Throttled { .. } => true,
            Self::Cosmos { source, .. } => is_transient(source),
            Self::BatchFailed { status, .. } => {
                matches!(status, 408 | 429 | 449 | 410) || *status >= 500
            }
            _ => false,
        }
    }

    /// The HTTP status Cosmos DB answered, when the error is one of its answers.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Throttled { source, .. } | Self::Cosmos { source, .. } => {
                Some(u16::from(source.status().status_code()))
            }
            _ => None,
        }
    }
}

/// Transient by status: throttled, timed out, gone, retry-with, a server error, or a
/// transport failure (which the SDK reports as a synthetic 503).
pub(crate) fn is_transient(e: &CosmosError) -> bool {
    let s = e.status();
    s.is_transient() || s.is_gone() || u16::from(s.status_code()) >= 500
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        match e {
            Error::TooLarge { field, len, limit } => StoreError::TooLarge { field, len, limit },
            Error::Corrupt { what } => StoreError::Corrupt { what },
            other => {
                let op = match &other {
                    Error::Throttled { op, .. } | Error::Cosmos { op, .. } => op,
                    _ => "cosmos",
                };
                StoreError::backend(op, other.is_retryable(), other)
            }
        }
    }
}
