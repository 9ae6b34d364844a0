//! The offset inbox, for ordered logs (Kafka, Event Hubs): the consumer group's position per
//! partition commits in the same transaction as the handlers' writes, so a redelivery is
//! recognised by its offset alone, with no per-message marker and nothing to purge.
//!
//! Per batch, one transaction of the [`TxInbox`]:
//!
//! 1. lock the position rows of the batch's partitions (created when missing), sorted, so
//!    concurrent batches (a member that lost its partition and the one that got it) wait for
//!    each other instead of both running;
//! 2. walk each partition's messages in offset order: an offset below the stored position is
//!    a **duplicate** (acked, handler not run); a message the consumer read after one that is
//!    not yet settled (see [`LogPosition::from`]) **waits** (retried, never run out of order);
//!    the others run, each with the transaction ([`Tx`]);
//! 3. with markers on ([`OffsetInbox::new`]), the running messages' keys are also marked in the
//!    same transaction, so a producer's duplicate (the same message id at a later offset) is a
//!    duplicate within the markers' retention;
//! 4. move each partition's position past the last message that ran or was a duplicate; commit.
//!
//! A handler that fails rolls the whole transaction back; the batch runs again without it and
//! without the later messages of its partition (they wait), so a position never passes a
//! message whose effect is not committed. A message that is dead-lettered stops its partition's
//! position too: the source tells later messages, once the copy is confirmed, that it is
//! settled (`from` reaches back past it).
//!
//! What it does not cover is in `docs/adr/0009-offset-inbox.md`: positions are per consumer
//! scope (a partition moving to another scope starts from that scope's position), a topic
//! re-created from offset 0 finds positions past its offsets (delete the rows), and without
//! markers a producer that retries without idempotence writes a second copy that runs.

use std::future::Future;
use std::pin::Pin;

use super::TxInbox;
use crate::StoreError;
#[cfg(doc)]
use crate::extract::LogPosition;
#[cfg(doc)]
use crate::inbox::Tx;

/// A partition of a log: (log name, partition number).
pub type Partition<'a> = (&'a str, i32);

/// What a [`PositionReader`] answers: each partition's stored next offset, in input order.
pub type StoredPositions<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<Option<i64>>, StoreError>> + Send + 'a>>;

/// The position primitives of an [`OffsetInbox`]: a row per (consumer scope, log, partition)
/// holding the next offset to process, read and written inside the inbox's transaction.
///
/// # Contract
/// - `lock_positions` locks the rows of `partitions` (distinct, sorted) until the transaction
///   ends, creating missing ones without a position, and answers their positions in input
///   order (`None`: none stored). A second transaction locking one of them waits.
/// - `advance` sets positions of rows this transaction locked, never moving one back.
/// - `read_positions` reads committed positions outside any transaction.
/// - Errors are [`StoreError`]s, retryable when the database says so (a deadlock).
pub trait TxPositions: TxInbox {
    /// Locks the position rows of `partitions` for `scope`; see the contract.
    ///
    /// # Errors
    /// Backend errors (the caller rolls back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the transaction commits.
    fn lock_positions<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        scope: &'a str,
        partitions: &'a [Partition<'a>],
    ) -> impl Future<Output = Result<Vec<Option<i64>>, StoreError>> + Send + 'a;

    /// Moves each partition's position to its next offset (never back).
    ///
    /// # Errors
    /// Backend errors (the caller rolls back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the transaction commits.
    fn advance<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        scope: &'a str,
        positions: &'a [(Partition<'a>, i64)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// The committed positions of `partitions` for `scope`, in input order.
    ///
    /// # Errors
    /// Backend errors; the positions table missing (run the store's `migrate()`).
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn read_positions<'a>(
        &'a self,
        scope: &'a str,
        partitions: &'a [Partition<'a>],
    ) -> impl Future<Output = Result<Vec<Option<i64>>, StoreError>> + Send + 'a;
}

/// Reads stored positions for a log source that seeks to them when partitions are assigned.
/// Object safe, so a source holds one without knowing the database: implemented by
/// [`OffsetInbox`].
pub trait PositionReader: Send + Sync + 'static {
    /// The committed positions of `partitions` for `scope`, in input order.
    ///
    /// # Errors
    /// The store's.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn read<'a>(&'a self, scope: &'a str, partitions: &'a [(String, i32)]) -> StoredPositions<'a>;
}

/// The offset inbox as an engine's backend (`Consumer::builder(source).offset_inbox(..)`):
/// each batch commits its partitions' positions with the handlers' writes in one transaction
/// of `I`, and the handler gets the transaction ([`Tx`]). For ordered logs only: every delivery
/// must carry a [`LogPosition`] (a delivery without one fails permanently).
///
/// Producer duplicates — one message id written twice, at two offsets — are caught by key
/// markers kept for the inbox's retention (the window, e.g. `store.inbox(one_hour)`), written
/// in the same transaction. [`without_markers`](Self::without_markers) drops them: then
/// the producer must not write duplicates (Kafka's `enable.idempotence=true`, which makes a
/// retried produce land once), since a second copy at a later offset runs again.
///
/// ```
/// use std::time::Duration;
/// use idem_core::inbox::{OffsetInbox, TxPositions};
///
/// fn modes<I: TxPositions + Clone>(inbox: I) {
///     // Markers for the inbox's retention catch a producer's retries.
///     let with_markers = OffsetInbox::new(inbox.clone());
///     assert!(with_markers.markers());
///     // Positions only: the producer is idempotent.
///     let positions_only = OffsetInbox::new(inbox).without_markers();
///     assert!(!positions_only.markers());
/// }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct OffsetInbox<I> {
    inbox: I,
    markers: bool,
}

impl<I: TxPositions> OffsetInbox<I> {
    /// Positions over `inbox`, with key markers kept for the inbox's retention.
    pub fn new(inbox: I) -> Self {
        Self { inbox, markers: true }
    }

    /// No key markers: only positions. State this only when the producer cannot write one
    /// message twice (Kafka's `enable.idempotence=true`, one producer per message id): a
    /// second copy at another offset runs again.
    pub fn without_markers(mut self) -> Self {
        self.markers = false;
        self
    }

    /// Whether key markers are written (producer duplicates caught within their retention).
    pub fn markers(&self) -> bool {
        self.markers
    }

    /// The inbox.
    pub fn inner(&self) -> &I {
        &self.inbox
    }

    /// The startup check: the inbox's, and the positions table answering a read (a store
    /// migrated before the offset inbox existed has none: run its `migrate()` again).
    pub(crate) async fn check(&self) -> Result<(), StoreError> {
        self.inbox.check().await?;
        match self.inbox.read_positions("", &[("", -1)]).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_retryable() => Err(e),
            Err(e) => Err(StoreError::NotMigrated {
                table: "<table>_positions".to_owned(),
                problem: format!("cannot be read ({})", crate::ErrorChain(&e)),
                migrate: "the store's migrate()",
            }),
        }
    }
}

impl<I: TxPositions> PositionReader for OffsetInbox<I> {
    fn read<'a>(&'a self, scope: &'a str, partitions: &'a [(String, i32)]) -> StoredPositions<'a> {
        Box::pin(async move {
            let parts: Vec<Partition<'_>> =
                partitions.iter().map(|(l, p)| (l.as_str(), *p)).collect();
            self.inbox.read_positions(scope, &parts).await
        })
    }
}
