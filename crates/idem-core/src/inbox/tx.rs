//! The batch transaction as an inbox handler holds it, lent for one handler at a time.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use super::TxInbox;
use crate::DedupKey;
use crate::outbox::OutboxId;

/// The transaction as an inbox handler holds it: write through it as through the database's
/// connection (`sqlx::query(…).execute(&mut *tx)`). Do not commit it or keep it: the inbox
/// commits the batch once every handler has returned, and a `Tx` kept past its handler fails
/// the batch.
pub struct Tx<I: TxInbox> {
    tx: Option<I::Transaction>,
    home: Arc<Mutex<Option<I::Transaction>>>,
    key: Option<DedupKey>,
    /// Outbox messages produced so far by this run of the handler.
    produced: u32,
}

impl<I: TxInbox> Tx<I> {
    /// The key of the message being handled (`None` for a message without one, processed
    /// without dedup by the missing-key policy).
    pub fn key(&self) -> Option<&DedupKey> {
        self.key.as_ref()
    }

    /// The id of the next outbox message this handler enqueues: derived from the message's key
    /// and how many it enqueued before ([`OutboxId::derived`]), so a handler that runs again
    /// (after a rollback) produces the same ids; random for a message without a key.
    pub fn next_outbox_id(&mut self) -> OutboxId {
        let id = match &self.key {
            Some(key) => OutboxId::derived(key, self.produced),
            None => OutboxId::random(),
        };
        self.produced += 1;
        id
    }
}

impl<I: TxInbox> std::fmt::Debug for Tx<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").field("key", &self.key).finish_non_exhaustive()
    }
}

impl<I: TxInbox> Deref for Tx<I> {
    type Target = I::Connection;

    fn deref(&self) -> &I::Connection {
        I::connection_ref(self.tx.as_ref().expect("a Tx holds its transaction until it is dropped"))
    }
}

impl<I: TxInbox> DerefMut for Tx<I> {
    fn deref_mut(&mut self) -> &mut I::Connection {
        I::connection(self.tx.as_mut().expect("a Tx holds its transaction until it is dropped"))
    }
}

impl<I: TxInbox> Drop for Tx<I> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.home.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        }
    }
}

/// The transaction of a round, lent to one handler at a time.
pub(crate) struct Lender<I: TxInbox> {
    home: Arc<Mutex<Option<I::Transaction>>>,
}

impl<I: TxInbox> Lender<I> {
    pub(crate) fn new(tx: I::Transaction) -> Self {
        Self { home: Arc::new(Mutex::new(Some(tx))) }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<I::Transaction>> {
        self.home.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The transaction as a handler's [`Tx`]; `None` if a handler kept it.
    pub(crate) fn lend(&self, key: Option<DedupKey>) -> Option<Tx<I>> {
        let tx = self.slot().take()?;
        Some(Tx { tx: Some(tx), home: Arc::clone(&self.home), key, produced: 0 })
    }

    /// The transaction back, once the handler's future (and with it its `Tx`) is gone; `None`
    /// when a handler kept its `Tx`.
    pub(crate) fn take(&self) -> Option<I::Transaction> {
        self.slot().take()
    }

    /// Puts the transaction back for the next step.
    pub(crate) fn put(&self, tx: I::Transaction) {
        *self.slot() = Some(tx);
    }
}

/// A handler kept its `Tx` beyond its future: the transaction cannot be finished (`what`: the
/// inbox's name in the error).
pub(crate) fn kept(what: &'static str) -> crate::StoreError {
    crate::StoreError::backend(
        what,
        true,
        "a handler kept its transaction beyond its future; the batch is rolled back",
    )
}
