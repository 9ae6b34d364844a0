//! The transactional inbox: the dedup marker commits in one transaction with the handler's
//! own writes, so a rollback leaves no marker and a commit leaves both.
//!
//! idem-core owns the decision; a database supplies the primitives of [`TxInbox`] — begin a
//! transaction, mark a batch of keys (a mark is a claim: its answers are [`Claim`]s), store
//! results, savepoints, commit — and nothing else. idem-sqlx implements them once per database
//! with SQL; idem-cosmos with a transactional batch. The decider ([`Inbox`] as an engine's
//! backend), per round of distinct keys:
//!
//! 1. begin; mark every key in one call (keys in hash order, so concurrent batches lock shared
//!    markers in one order and wait instead of deadlocking);
//! 2. run the handlers of the keys acquired, in delivery order, each with the transaction
//!    ([`Tx`]);
//! 3. store their results in one call; commit. Nothing is acknowledged before that commit.
//!
//! A handler that fails leaves the transaction in doubt (PostgreSQL aborts it on any error), so
//! the round is rolled back and the rest of it runs again, each message in its own savepoint
//! with its own mark: a failing message rolls back alone. An inbox handler may therefore run
//! twice for one delivery; only its writes through the transaction count, and they commit once.

mod offset;
mod one;
pub(crate) mod tx;

use std::future::Future;
use std::time::Duration;

use crate::outcome::{HandlerError, Outcome};
use crate::{Claim, DedupKey, Fingerprint, StoreError};

pub use offset::{OffsetInbox, Partition, PositionReader, StoredPositions, TxPositions};
pub use tx::Tx;

/// The primitives of a transactional inbox, as idem-core's inbox decider calls them. Nothing
/// here decides: an implementation runs its statements and answers.
///
/// # Contract
/// - `mark_many` is one atomic conditional write per key inside the transaction (an upsert on
///   a unique key): of concurrent transactions marking a key, one gets [`Claim::Acquired`]; the
///   others wait for it and then see its marker ([`Claim::Completed`]) if it committed, or
///   acquire if it rolled back. A marker with another fingerprint answers [`Claim::Conflict`]; a
///   live two-phase lease on the key, [`Claim::InProgress`] with the store's remaining time.
///   Answers are in input order; the keys of one call are distinct.
/// - Nothing is visible outside the transaction before `commit`; `rollback` (or dropping the
///   transaction) leaves no marker and none of the handlers' writes.
/// - An inbox whose marks are only written at commit ([`ANSWERS_AT_COMMIT`](Self::ANSWERS_AT_COMMIT))
///   answers [`Claim::Acquired`] provisionally and gives the real answers from `commit`.
/// - Errors are [`StoreError`]s, retryable when the database says so (a deadlock, a
///   serialization failure, a lost connection).
///
/// `idem-testkit`'s `tx_inbox_conformance!` checks an implementation against a real database.
pub trait TxInbox: Send + Sync + Sized + 'static {
    /// An open transaction.
    type Transaction: Send + 'static;
    /// What a handler writes through: `&mut *tx` of a [`Tx`] is a `&mut Self::Connection`.
    type Connection: ?Sized + Send;

    /// Whether marks are written only at commit, one message per transaction: `mark_many`
    /// answers provisionally and `commit` answers for real (Cosmos DB's transactional batch).
    const ANSWERS_AT_COMMIT: bool = false;

    /// The connection inside a transaction.
    fn connection(tx: &mut Self::Transaction) -> &mut Self::Connection;

    /// The connection inside a transaction, shared.
    fn connection_ref(tx: &Self::Transaction) -> &Self::Connection;

    /// How long markers are kept.
    fn retention(&self) -> Duration;

    /// The startup check a consumer's `build` runs (the markers' table exists with its
    /// columns), as [`DedupStore::check`](crate::DedupStore::check): an error when the inbox
    /// cannot work, else the warnings. Default: nothing to check.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`] naming what to run; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn check(&self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Begins a transaction.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: a transaction dropped before `commit` is rolled back.
    fn begin(&self) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;

    /// Marks distinct keys inside the transaction; answers in input order (see the contract).
    ///
    /// # Errors
    /// Backend errors (the caller rolls back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the transaction commits.
    fn mark_many<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        items: &'a [(DedupKey, Option<Fingerprint>)],
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send + 'a;

    /// Marks one key inside the transaction: [`mark_many`](Self::mark_many) with one item.
    /// What a caller with a transaction of its own uses: mark, write if the claim is
    /// [`Claim::Acquired`], commit.
    ///
    /// # Errors
    /// As [`mark_many`](Self::mark_many).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the transaction commits.
    fn mark<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        key: &'a DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        async move {
            let item = [(key.clone(), fingerprint)];
            let mut claims = self.mark_many(conn, &item).await?;
            match (claims.pop(), claims.is_empty()) {
                (Some(claim), true) => Ok(claim),
                _ => Err(StoreError::backend("mark", true, WrongCount)),
            }
        }
    }

    /// Stores handler results with their markers, inside the transaction.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] above the inbox's limit; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the transaction commits.
    fn set_results<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        items: &'a [(DedupKey, Vec<u8>)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Sets, releases or rolls back to the one savepoint the decider uses per message. Never
    /// called on an inbox that [answers at commit](Self::ANSWERS_AT_COMMIT).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: the transaction is rolled back as a whole if it is dropped.
    fn savepoint<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        step: Savepoint,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Commits: `None` when the marks' answers stand, or the real answers of an inbox that
    /// [answers at commit](Self::ANSWERS_AT_COMMIT), in the order of its marks.
    ///
    /// # Errors
    /// Backend errors: nothing was committed.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped while committing, the transaction may or may not have
    /// committed (the broker redelivers, and the store says which).
    fn commit(
        &self,
        tx: Self::Transaction,
    ) -> impl Future<Output = Result<Option<Vec<Claim>>, StoreError>> + Send;

    /// Rolls back.
    ///
    /// # Errors
    /// Backend errors (the transaction is gone either way).
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn rollback(
        &self,
        tx: Self::Transaction,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Where the inbox keeps crash notes, if it does: what catches a message that kills the
    /// process in inbox mode. A message the broker redelivered runs alone, under a two-phase
    /// claim of a note (a key of its own, derived from the message's) in this store, taken
    /// outside any transaction and given back when its run ends in a live process; a process
    /// that dies running it leaves the note's lease to run out, and the next claim counts a
    /// death ([`Lease::deaths`](crate::Lease::deaths)). SQL inboxes keep their notes in the
    /// markers' own table. Default: none (no crash-loop detection).
    fn crash_note_store(&self) -> Option<&impl crate::DedupStore> {
        None::<&crate::MemoryStore>
    }

    /// Whether a failure to commit can never succeed (an entity too large to store): the
    /// message is then dead-lettered instead of retried. Default: none is.
    fn is_permanent(e: &StoreError) -> bool {
        let _ = e;
        false
    }

    /// Whether a failure is the database giving up on the transaction to keep it serializable
    /// (PostgreSQL's `40001` serialization failure or `40P01` deadlock, MySQL's and Galera's
    /// `1213`): nothing of it is committed, and the whole transaction may run again. The
    /// engine then runs the batch again, up to a bound, with a random pause. Default: none is.
    fn is_serialization_failure(e: &StoreError) -> bool {
        let _ = e;
        false
    }

    /// One message in its own transaction: begin, mark `key`, run `writes` with the
    /// transaction only if the mark is acquired, store its result (JSON) with the marker,
    /// commit. Anything else rolls everything back, marker included. What a caller outside any
    /// broker uses; the answer is the [`Outcome`] a consumer would give.
    ///
    /// ```
    /// use idem_core::{DedupKey, Fingerprint, Outcome, engine::HandlerError, inbox::TxInbox};
    ///
    /// async fn store_order<I: TxInbox>(inbox: &I) -> Result<(), idem_core::KeyError> {
    ///     let key = DedupKey::new("order-writer", "o-1")?;
    ///     let outcome = inbox
    ///         .process(&key, Some(Fingerprint::of_bytes(b"o-1")), |_tx| async move {
    ///             // write through `&mut *tx`
    ///             Ok::<_, HandlerError<String>>("stored".to_owned())
    ///         })
    ///         .await;
    ///     assert!(matches!(outcome, Outcome::Processed(_) | Outcome::Duplicate(_)));
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # Cancel safety
    /// As [`commit`](Self::commit): dropped before it, nothing is written.
    fn process<T, E, F, Fut>(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> impl Future<Output = Outcome<T, E>>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(Tx<Self>) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        one::process_one(self, key, fingerprint, writes)
    }
}

/// A step of the per-message savepoint ([`TxInbox::savepoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Savepoint {
    /// `SAVEPOINT idem_msg`.
    Set,
    /// `RELEASE SAVEPOINT idem_msg; SAVEPOINT idem_msg` (one round trip where the driver takes
    /// two statements at once).
    ReleaseAndSet,
    /// `ROLLBACK TO SAVEPOINT idem_msg`.
    RollBack,
}

impl Savepoint {
    /// The SQL of this step: one statement, or two separated by `;`.
    pub fn sql(self) -> &'static str {
        match self {
            Self::Set => "SAVEPOINT idem_msg",
            Self::ReleaseAndSet => "RELEASE SAVEPOINT idem_msg; SAVEPOINT idem_msg",
            Self::RollBack => "ROLLBACK TO SAVEPOINT idem_msg",
        }
    }
}

/// A transactional inbox as an engine's backend: `Consumer::builder(source).inbox(inbox)` (or
/// `Engine::builder(Inbox::new(inbox))`) runs each batch through one transaction of `I`, and
/// the handler gets the transaction ([`Tx`]).
#[derive(Debug, Clone)]
pub struct Inbox<I>(I);

impl<I: TxInbox> Inbox<I> {
    /// `inbox` as an engine's backend.
    pub fn new(inbox: I) -> Self {
        Self(inbox)
    }

    /// The inbox.
    pub fn inner(&self) -> &I {
        &self.0
    }
}

impl<I> std::ops::Deref for Inbox<I> {
    type Target = I;

    fn deref(&self) -> &I {
        &self.0
    }
}

/// An inbox that answered a batch of marks (or positions) with the wrong number of rows.
#[derive(Debug, thiserror::Error)]
#[error("the inbox answered with the wrong number of rows")]
pub(crate) struct WrongCount;
