//! The transactional inbox on SQLite: the dedup marker commits with the caller's writes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_core::claim::next_token;
use idem_core::{DedupKey, Fingerprint, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::AssertSqlSafe;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use super::{SqliteStore, backend};
use crate::row::i64_of;
use crate::row::{Loser, classify_loser};
use crate::{InboxError, InboxOutcome, MAX_RESULT_BYTES, Mark};

/// Records dedup markers inside the caller's own SQLite transaction (R4): the marker and the
/// business writes commit together, and a rollback leaves no marker.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{DedupKey, Fingerprint};
/// use idem_sqlx::{Mark, SqliteStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("shop.sqlite")).await?;
/// sqlx::query("CREATE TABLE orders (id TEXT, cents INTEGER)").execute(store.pool()).await?;
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let fp = Fingerprint::of_bytes(b"o-1:1200");
///
/// let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
/// if inbox.mark(&mut tx, &key, Some(fp)).await? == Mark::First {
///     sqlx::query("INSERT INTO orders VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// tx.commit().await?; // then ack the message
///
/// let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
/// assert!(matches!(inbox.mark(&mut tx, &key, Some(fp)).await?, Mark::Duplicate(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteInbox {
    store: SqliteStore,
    retain_for: Duration,
}

/// The caller's writes for [`SqliteInbox::process`]: a closure returning a boxed future that
/// borrows the transaction's connection.
pub type Writes<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

impl SqliteInbox {
    pub(super) fn new(store: SqliteStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// Inserts the marker for `key` on the caller's connection (inside their transaction).
    ///
    /// Returns [`Mark::First`] when this transaction owns the key: do the writes and commit.
    /// Anything else means do not write. A concurrent transaction marking the same key waits on
    /// SQLite's write lock, then sees this one's committed marker — or proceeds if it rolled back.
    ///
    /// Begin the transaction with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN IMMEDIATE")`): a
    /// deferred transaction that has read first may fail with `SQLITE_BUSY` when it writes.
    ///
    /// # Errors
    /// Backend errors (the caller should roll back).
    pub async fn mark(
        &self,
        conn: &mut SqliteConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Mark, StoreError> {
        let s = &self.store;
        for _ in 0..8 {
            let now = s.now();
            let done = sqlx::query(AssertSqlSafe(Arc::clone(&s.sql.mark)))
                .bind(&key.hash().0[..])
                .bind(key.scope())
                .bind(key.id())
                .bind(fingerprint.as_ref().map(|f| &f.0[..]))
                .bind(now.as_micros())
                .bind(None::<i64>)
                .bind(now.plus(self.retain_for).as_micros())
                .bind(i64_of(next_token(None, now), "token")?)
                .execute(&mut *conn)
                .await
                .map_err(|e| backend("mark", e))?;
            if done.rows_affected() == 1 {
                return Ok(Mark::First);
            }
            let Some(rec) = s.fetch(conn, key).await? else { continue };
            match classify_loser(rec, fingerprint, now) {
                Some(Loser::Done(r)) => return Ok(Mark::Duplicate(r)),
                Some(Loser::Conflict(r)) => return Ok(Mark::Conflict(r)),
                Some(Loser::Leased(r)) => return Ok(Mark::InProgress(r)),
                None => {}
            }
        }
        Err(StoreError::backend("mark", true, "record kept changing under the mark (8 tries)"))
    }

    /// Stores a result with the marker, in the same transaction, for duplicates to return.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] above 1 MiB; backend errors.
    pub async fn set_result(
        &self,
        conn: &mut SqliteConnection,
        key: &DedupKey,
        result: &[u8],
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.len(), MAX_RESULT_BYTES)?;
        sqlx::query(AssertSqlSafe(Arc::clone(&self.store.sql.set_result)))
            .bind(&key.hash().0[..])
            .bind(result)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("set_result", e))?;
        Ok(())
    }

    /// Opens a `BEGIN IMMEDIATE` transaction on `pool`, marks `key`, runs `writes` only if the
    /// mark is first, stores their result (JSON) with the marker and commits. Any error rolls
    /// everything back, marker included.
    ///
    /// # Errors
    /// [`InboxError::Writes`] when `writes` fails, [`InboxError::Store`] otherwise.
    pub async fn process<T, E, F>(
        &self,
        pool: &SqlitePool,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> Result<InboxOutcome<T>, InboxError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> Writes<'c, T, E>,
    {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| backend("process", e))?;
        if let Some(done) = crate::row::settled(self.mark(&mut tx, key, fingerprint).await?)? {
            return Ok(done);
        }
        let value = writes(&mut tx).await.map_err(InboxError::Writes)?;
        if let Ok(bytes) = serde_json::to_vec(&value)
            && bytes.len() <= MAX_RESULT_BYTES
        {
            self.set_result(&mut tx, key, &bytes).await?;
        }
        tx.commit().await.map_err(|e| backend("commit", e))?;
        Ok(InboxOutcome::Processed(value))
    }
}
