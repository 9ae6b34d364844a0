//! The transactional inbox on MySQL / MariaDB.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{DedupKey, Fingerprint, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::mysql::{MySqlConnection, MySqlPool};

use super::{MySqlStore, backend, error_number, nonce};
use crate::row::{Loser, classify_loser};
use crate::{InboxError, InboxOutcome, MAX_RESULT_BYTES, Mark};

/// Records dedup markers inside the caller's own MySQL/MariaDB transaction (R4).
///
/// `mark` is a plain `INSERT`: a duplicate key (error 1062) only fails that statement, never
/// the caller's transaction, and is mapped to *duplicate* (or *conflict*) after reading the row
/// with a locking read. It is not `INSERT IGNORE` (which would truncate and hide errors) and
/// not `ON DUPLICATE KEY UPDATE` (which cannot tell an insert from a duplicate here). A second
/// transaction marking the same key waits on the first's row lock, then sees *duplicate* — or
/// *first* if the first rolled back. A deadlock (1213) rolls back the caller's whole
/// transaction; it is reported as a retryable error: run the transaction again.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::DedupKey;
/// use idem_sqlx::{Mark, MySqlStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let mut tx = store.pool().begin().await?;
/// if inbox.mark(&mut tx, &key, None).await? == Mark::First {
///     sqlx::query("INSERT INTO orders (id, cents) VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// tx.commit().await?; // then ack the message
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlInbox {
    store: MySqlStore,
    retain_for: Duration,
}

/// The caller's writes for [`MySqlInbox::process`].
pub type MySqlWrites<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

impl MySqlInbox {
    pub(super) fn new(store: MySqlStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// Inserts the marker for `key` inside the caller's transaction; [`Mark::First`] means do
    /// the writes and commit, anything else means do not write.
    ///
    /// # Errors
    /// Backend errors (roll back; retry when [`StoreError::is_retryable`]).
    pub async fn mark(
        &self,
        conn: &mut MySqlConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Mark, StoreError> {
        let s = &self.store;
        let b = s
            .binds()
            .bytes("hash", Some(&key.hash().0))
            .text("scope", key.scope())
            .text("id", key.id())
            .bytes("fp", fingerprint.as_ref().map(|f| &f.0[..]))
            .int("keep", Some(duration_micros(self.retain_for)))
            .int("owner", Some(nonce()));
        for _ in 0..8 {
            match s.sql.insert_marker.query(&b).execute(&mut *conn).await {
                Ok(_) => return Ok(Mark::First),
                Err(e) if error_number(&e) == Some(1062) => {}
                Err(e) => return Err(backend("mark", e)),
            }
            // The key exists: take it over if it expired or was released, else explain.
            let took = s
                .sql
                .take_marker
                .query(&b)
                .execute(&mut *conn)
                .await
                .map_err(|e| backend("mark", e))?;
            if took.rows_affected() == 1 {
                return Ok(Mark::First);
            }
            let Some((rec, now)) = s.fetch(conn, key, true).await? else { continue };
            match classify_loser(rec, fingerprint, now) {
                Some(Loser::Done(r)) => return Ok(Mark::Duplicate(r)),
                Some(Loser::Conflict(r)) => return Ok(Mark::Conflict(r)),
                Some(Loser::Leased(r)) => return Ok(Mark::InProgress(r)),
                None => {}
            }
        }
        Err(StoreError::backend("mark", true, "record kept changing under the mark (8 tries)"))
    }

    /// Stores a result with the marker, in the same transaction.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] above 1 MiB; backend errors.
    pub async fn set_result(
        &self,
        conn: &mut MySqlConnection,
        key: &DedupKey,
        result: &[u8],
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.len(), MAX_RESULT_BYTES)?;
        let b = self.store.binds().bytes("hash", Some(&key.hash().0)).bytes("result", Some(result));
        self.store
            .sql
            .set_result
            .query(&b)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("set_result", e))?;
        Ok(())
    }

    /// Opens a transaction, marks `key`, runs `writes` only if first, stores their result
    /// (JSON) and commits; any error rolls everything back, marker included.
    ///
    /// # Errors
    /// [`InboxError::Writes`] when `writes` fails, [`InboxError::Store`] otherwise.
    pub async fn process<T, E, F>(
        &self,
        pool: &MySqlPool,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> Result<InboxOutcome<T>, InboxError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> MySqlWrites<'c, T, E>,
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
