//! `BatchDocs`: the transactional batch being built — what the handler writes, and the marker
//! the inbox writes with it.

use idem_core::{DedupKey, Fingerprint};
use serde::Serialize;
use serde_json::Value;

use crate::Error;
use crate::limits::check_partition_key;

/// One write of the batch.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Create(Value),
    Upsert(Value),
    Delete(String),
}

/// The dedup marker to write with the batch: the message's key and fingerprint, and the
/// handler's result once it has one.
#[derive(Debug)]
pub(crate) struct PendingMarker {
    pub(crate) key: DedupKey,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) result: Option<Vec<u8>>,
}

/// One [`CosmosInbox`](crate::CosmosInbox) transaction: the business documents to commit with
/// the dedup marker, in one transactional batch under one partition key. An inbox handler
/// writes through its `Tx<CosmosInbox>`, which dereferences to this. Nothing is written until
/// the handler returns `Ok`; then the marker and these documents commit together or not at all.
///
/// Set the partition key (the entity, e.g. the order id) before or after adding documents;
/// without one the batch goes to the partition named by the dedup key's id. Every document
/// must hold that partition key at the container's partition key path, or the batch fails
/// with [`Error::WrongPartition`] before any request.
///
/// ```
/// # fn f(docs: &mut idem_cosmos::BatchDocs) -> Result<(), idem_cosmos::Error> {
/// docs.set_partition_key("o-42")?;
/// docs.create(&serde_json::json!({"id": "o-42", "orderId": "o-42", "total": 10}))?;
/// docs.create(&serde_json::json!({"id": "o-42-line-1", "orderId": "o-42", "sku": "A"}))?;
/// # Ok(()) }
/// ```
pub struct BatchDocs {
    pub(crate) partition_key: Option<String>,
    pub(crate) ops: Vec<Op>,
    pub(crate) marker: Option<PendingMarker>,
}

// Counts only: the documents are business data, and the key belongs to the message.
impl std::fmt::Debug for BatchDocs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchDocs")
            .field("partition_key_set", &self.partition_key.is_some())
            .field("operations", &self.ops.len())
            .field("marked", &self.marker.is_some())
            .finish()
    }
}

impl BatchDocs {
    /// An empty batch: no documents, no marker.
    pub(crate) fn new() -> Self {
        Self { partition_key: None, ops: Vec::new(), marker: None }
    }

    /// Commits the batch under partition key `value`.
    ///
    /// # Errors
    /// [`Error::InvalidPartitionKey`] (empty, over 2 KiB).
    pub fn set_partition_key(&mut self, value: impl Into<String>) -> Result<(), Error> {
        let value = value.into();
        check_partition_key(&value)?;
        self.partition_key = Some(value);
        Ok(())
    }

    /// Creates `doc` (fails the batch with a 409 if it exists).
    ///
    /// # Errors
    /// [`Error::Json`] when it does not serialize.
    pub fn create<T: Serialize>(&mut self, doc: &T) -> Result<(), Error> {
        self.ops.push(Op::Create(to_value(doc)?));
        Ok(())
    }

    /// Creates or replaces `doc`.
    ///
    /// # Errors
    /// As [`BatchDocs::create`].
    pub fn upsert<T: Serialize>(&mut self, doc: &T) -> Result<(), Error> {
        self.ops.push(Op::Upsert(to_value(doc)?));
        Ok(())
    }

    /// Deletes the document `id` of the batch's partition (fails the batch with a 404 if
    /// absent).
    pub fn delete(&mut self, id: impl Into<String>) {
        self.ops.push(Op::Delete(id.into()));
    }
}

fn to_value<T: Serialize>(doc: &T) -> Result<Value, Error> {
    serde_json::to_value(doc)
        .map_err(|source| Error::Json { what: "document does not serialize", source })
}
