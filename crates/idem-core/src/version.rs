//! Natural idempotency: a version guard for event-carried state transfer.

use std::future::Future;

use crate::{DedupKey, StoreError};

/// The answer of [`VersionGuard::advance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Advance {
    /// The version is newer than any seen: apply the message.
    Applied,
    /// The version is not newer than the one already applied: skip (ack) the message.
    Stale {
        /// The highest version applied so far.
        current: i64,
    },
}

/// Records the highest version seen per entity and reports older (or equal) versions as stale.
///
/// Use it when messages carry the entity's full state and a version or sequence number: applying
/// only newer versions makes the consumer idempotent and tolerant of reordering, with no dedup
/// record per message. The check and the update are one atomic conditional write.
pub trait VersionGuard: Send + Sync {
    /// Raises the stored version of `entity` to `version` if it is higher.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: the version was raised or it was not.
    fn advance(
        &self,
        entity: &DedupKey,
        version: i64,
    ) -> impl Future<Output = Result<Advance, StoreError>> + Send;
}
