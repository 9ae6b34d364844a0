//! `CosmosInbox` as a [`TxInbox`]: a transaction is the batch being built ([`BatchDocs`]); a
//! mark only records the marker to write, and the commit — one transactional batch — answers
//! for it.

use std::time::Duration;

use idem_core::inbox::{Savepoint, TxInbox};
use idem_core::{Claim, DedupKey, DedupStore, Fingerprint, StoreError};

use super::CosmosInbox;
use super::docs::{BatchDocs, PendingMarker};
use crate::Error;
use crate::marker::entity_lease;

impl TxInbox for CosmosInbox {
    type Transaction = BatchDocs;
    type Connection = BatchDocs;

    /// The marker is written with the documents, in the batch: a mark can only be answered by
    /// the commit.
    const ANSWERS_AT_COMMIT: bool = true;

    /// The notes' store, when there is one ([`CosmosInbox::crash_notes`]).
    fn crash_note_store(&self) -> Option<&impl DedupStore> {
        self.notes.as_ref()
    }

    fn connection(tx: &mut BatchDocs) -> &mut BatchDocs {
        tx
    }

    fn connection_ref(tx: &BatchDocs) -> &BatchDocs {
        tx
    }

    fn retention(&self) -> Duration {
        self.retention
    }

    /// An empty batch; nothing is sent before the commit.
    async fn begin(&self) -> Result<BatchDocs, StoreError> {
        Ok(BatchDocs::new())
    }

    /// Records the marker to write and answers [`Claim::Acquired`] provisionally (the commit
    /// gives the real answer). A batch holds one marker: the decider gives an inbox that answers
    /// at commit one message per transaction.
    async fn mark_many(
        &self,
        batch: &mut BatchDocs,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Claim>, StoreError> {
        match items {
            [] => Ok(Vec::new()),
            [(key, fingerprint)] if batch.marker.is_none() => {
                let (key, fingerprint) = (key.clone(), *fingerprint);
                let lease = entity_lease(&key, fingerprint);
                batch.marker = Some(PendingMarker { key, fingerprint, result: None });
                Ok(vec![Claim::Acquired(lease)])
            }
            _ => Err(StoreError::backend("mark_many", false, OneMarker)),
        }
    }

    /// Keeps the result for the marker (the batch's size check at commit bounds it).
    async fn set_results(
        &self,
        batch: &mut BatchDocs,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        if let Some(marker) = batch.marker.as_mut()
            && let Some((_, result)) = items.iter().find(|(k, _)| *k == marker.key)
        {
            marker.result = Some(result.clone());
        }
        Ok(())
    }

    /// Never called: an inbox that answers at commit runs one message per transaction, so a
    /// failing handler's batch is simply dropped.
    async fn savepoint(&self, _: &mut BatchDocs, _: Savepoint) -> Result<(), StoreError> {
        Ok(())
    }

    /// Sends the batch: the marker's answer ([`Claim::Acquired`] when it committed; on a 409,
    /// the stored marker's [`Claim::Completed`] or [`Claim::Conflict`], and nothing was
    /// written), or no answer for a message without a key, whose documents commit unmarked.
    async fn commit(&self, batch: BatchDocs) -> Result<Option<Vec<Claim>>, StoreError> {
        let BatchDocs { partition_key, ops, marker } = batch;
        let Some(marker) = marker else {
            if ops.is_empty() {
                return Ok(Some(Vec::new()));
            }
            let Some(partition) = partition_key else {
                return Err(Error::InvalidPartitionKey {
                    reason: "a message without a dedup key must set the batch's partition key",
                }
                .into());
            };
            self.commit_unmarked(&partition, ops).await?;
            return Ok(Some(Vec::new()));
        };
        let partition = partition_key.unwrap_or_else(|| marker.key.id().to_owned());
        let claim = self.commit_marked(&marker, &partition, ops).await?;
        Ok(Some(vec![claim]))
    }

    /// Drops the batch: nothing was sent.
    async fn rollback(&self, batch: BatchDocs) -> Result<(), StoreError> {
        drop(batch);
        Ok(())
    }

    /// A batch Cosmos DB's rules refuse (an invalid id or partition key, too large, too many
    /// operations, a document in another partition or not JSON) or that meets an entity
    /// written by something else can never commit; throttling, outages and the rest may.
    fn is_permanent(e: &StoreError) -> bool {
        match e {
            StoreError::TooLarge { .. } => true,
            StoreError::Backend { source, .. } => {
                source.downcast_ref::<Error>().is_some_and(never_commits)
            }
            _ => false,
        }
    }
}

fn never_commits(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidId { .. }
            | Error::InvalidPartitionKey { .. }
            | Error::InvalidPath { .. }
            | Error::TooLarge { .. }
            | Error::TooManyOperations { .. }
            | Error::WrongPartition { .. }
            | Error::Json { .. }
            | Error::Exists { .. }
    )
}

/// `mark_many` with more than one key, or on a batch already marked.
#[derive(Debug, thiserror::Error)]
#[error("a Cosmos DB inbox batch holds one marker: mark one key per transaction")]
struct OneMarker;
