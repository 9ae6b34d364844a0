//! The transactional inbox on PostgreSQL: the dedup marker commits with the caller's writes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimRequest, DedupKey, Fingerprint, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnection, PgPool};

use super::{PostgresStore, backend};
use crate::row::{Loser, classify_loser};
use crate::{InboxError, InboxOutcome, MAX_RESULT_BYTES, Mark};

/// Records dedup markers inside the caller's own PostgreSQL transaction (R4): the marker and
/// the business writes commit together, and a rollback leaves no marker.
///
/// `mark` never raises an error inside the caller's transaction: it is one
/// `INSERT … ON CONFLICT DO UPDATE … WHERE <expired or released>` that, on an existing live
/// marker, changes nothing and returns no row; the existing row is then read. (A unique
/// violation would abort the whole transaction.) A second transaction marking the same key
/// waits for the first on the row lock, then sees *duplicate* if it committed, or *first* if it
/// rolled back. Use the default `READ COMMITTED` isolation: under `REPEATABLE READ` that
/// concurrent duplicate surfaces as a serialization failure (retryable) instead.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{DedupKey, Fingerprint};
/// use idem_sqlx::{Mark, PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let mut tx = store.pool().begin().await?;
/// if inbox.mark(&mut tx, &key, Some(Fingerprint::of_bytes(b"o-1:1200"))).await? == Mark::First {
///     sqlx::query("INSERT INTO orders (id, cents) VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// tx.commit().await?; // then ack the message
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresInbox {
    store: PostgresStore,
    retain_for: Duration,
}

/// The caller's writes for [`PostgresInbox::process`]: a closure returning a boxed future that
/// borrows the transaction's connection.
pub type PgWrites<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

impl PostgresInbox {
    pub(super) fn new(store: PostgresStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// Inserts the marker for `key` on the caller's connection (inside their transaction).
    ///
    /// [`Mark::First`]: this transaction owns the key — do the writes and commit. Anything else
    /// means do not write.
    ///
    /// # Errors
    /// Backend errors (the caller should roll back).
    pub async fn mark(
        &self,
        conn: &mut PgConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Mark, StoreError> {
        let s = &self.store;
        let req = ClaimRequest::new(key.clone(), fingerprint, Duration::ZERO, self.retain_for);
        for _ in 0..8 {
            if s.upsert(conn, &s.sql.mark, &req, None).await?.is_some() {
                return Ok(Mark::First);
            }
            let Some((rec, now)) = s.fetch(conn, key).await? else { continue };
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
        conn: &mut PgConnection,
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

    /// Opens a transaction on `pool`, marks `key`, runs `writes` only if the mark is first,
    /// stores their result (JSON) with the marker and commits. Any error rolls everything back,
    /// marker included.
    ///
    /// # Errors
    /// [`InboxError::Writes`] when `writes` fails, [`InboxError::Store`] otherwise.
    pub async fn process<T, E, F>(
        &self,
        pool: &PgPool,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> Result<InboxOutcome<T>, InboxError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut PgConnection) -> PgWrites<'c, T, E>,
    {
        let mut tx = pool.begin().await.map_err(|e| backend("process", e))?;
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
