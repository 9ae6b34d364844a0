//! `BatchDocs`: what an inbox handler writes, committed with the marker in one batch.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idem_core::DedupKey;
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

/// What the handler has written so far.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub(crate) partition_key: Option<String>,
    pub(crate) ops: Vec<Op>,
    closed: bool,
}

/// The handler's side of a [`CosmosInbox`](crate::CosmosInbox) delivery: the business
/// documents to commit with the dedup marker, in one transactional batch under one partition
/// key. Nothing is written until the handler returns `Ok`; then the marker and these
/// documents commit together or not at all.
///
/// Set the partition key (the entity, e.g. the order id) before or after adding documents;
/// without one the batch goes to the partition named by the dedup key's id. Every document
/// must hold that partition key at the container's partition key path, or the batch fails
/// with [`Error::WrongPartition`] before any request.
///
/// ```
/// # fn f(docs: idem_cosmos::BatchDocs) -> Result<(), idem_cosmos::Error> {
/// docs.set_partition_key("o-42")?;
/// docs.create(&serde_json::json!({"id": "o-42", "orderId": "o-42", "total": 10}))?;
/// docs.create(&serde_json::json!({"id": "o-42-line-1", "orderId": "o-42", "sku": "A"}))?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct BatchDocs {
    key: Option<DedupKey>,
    shared: Arc<Mutex<Pending>>,
}

impl BatchDocs {
    /// A context for one delivery and the inbox's handle on what it writes.
    pub(crate) fn new(key: Option<DedupKey>) -> (Self, Arc<Mutex<Pending>>) {
        let shared = Arc::new(Mutex::new(Pending::default()));
        (Self { key, shared: Arc::clone(&shared) }, shared)
    }

    fn lock(&self) -> Result<MutexGuard<'_, Pending>, Error> {
        // A panic while holding the lock leaves at most one half-pushed op: still a valid list.
        let guard = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.closed { Err(Error::BatchClosed) } else { Ok(guard) }
    }

    /// The key of the message being handled (`None` for a message without one, processed
    /// without dedup by the consumer's missing-key policy).
    pub fn key(&self) -> Option<&DedupKey> {
        self.key.as_ref()
    }

    /// Commits the batch under partition key `value`.
    ///
    /// # Errors
    /// [`Error::InvalidPartitionKey`] (empty, over 2 KiB); [`Error::BatchClosed`].
    pub fn set_partition_key(&self, value: impl Into<String>) -> Result<(), Error> {
        let value = value.into();
        check_partition_key(&value)?;
        self.lock()?.partition_key = Some(value);
        Ok(())
    }

    /// Creates `doc` (fails the batch with a 409 if it exists).
    ///
    /// # Errors
    /// [`Error::Json`] when it does not serialize; [`Error::BatchClosed`].
    pub fn create<T: Serialize>(&self, doc: &T) -> Result<(), Error> {
        let v = to_value(doc)?;
        self.lock()?.ops.push(Op::Create(v));
        Ok(())
    }

    /// Creates or replaces `doc`.
    ///
    /// # Errors
    /// As [`BatchDocs::create`].
    pub fn upsert<T: Serialize>(&self, doc: &T) -> Result<(), Error> {
        let v = to_value(doc)?;
        self.lock()?.ops.push(Op::Upsert(v));
        Ok(())
    }

    /// Deletes the document `id` of the batch's partition (fails the batch with a 404 if absent).
    ///
    /// # Errors
    /// [`Error::BatchClosed`].
    pub fn delete(&self, id: impl Into<String>) -> Result<(), Error> {
        self.lock()?.ops.push(Op::Delete(id.into()));
        Ok(())
    }
}

/// Takes what the handler wrote and closes its context to further writes.
pub(crate) fn close(shared: &Arc<Mutex<Pending>>) -> (Option<String>, Vec<Op>) {
    let mut p = shared.lock().unwrap_or_else(PoisonError::into_inner);
    p.closed = true;
    (p.partition_key.take(), std::mem::take(&mut p.ops))
}

fn to_value<T: Serialize>(doc: &T) -> Result<Value, Error> {
    serde_json::to_value(doc)
        .map_err(|source| Error::Json { what: "document does not serialize", source })
}
