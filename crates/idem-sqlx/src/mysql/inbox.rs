//! The transactional inbox on MySQL / MariaDB.

use std::future::Future;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{ClaimRequest, DedupKey, Fingerprint, RecordState, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::mysql::{MySqlConnection, MySqlPool};

use super::{MySqlStore, backend, error_number, nonce};
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
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
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

impl MySqlInbox {
    pub(super) fn new(store: MySqlStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// The store's pool (where batch transactions begin).
    pub fn pool(&self) -> &MySqlPool {
        self.store.pool()
    }

    /// How long markers are kept.
    pub fn retention(&self) -> Duration {
        self.retain_for
    }

    /// The store's startup check ([`MySqlStore::check`]), which a consumer's `build` runs: the
    /// markers' table must exist with its columns.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`](idem_core::StoreError::NotMigrated); backend errors.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        self.store.check().await
    }

    /// Marks distinct keys with one upsert on the caller's connection (inside their
    /// transaction), rows in key-hash order, then one locking read of the rows; answers in input
    /// order, each as [`mark`](Self::mark) would.
    ///
    /// # Errors
    /// Backend errors (roll back; retry when [`StoreError::is_retryable`]).
    pub async fn mark_many(
        &self,
        conn: &mut MySqlConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Mark>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(super::MAX_ROWS) {
            let reqs: Vec<ClaimRequest> = chunk
                .iter()
                .map(|(k, fp)| ClaimRequest::new(k.clone(), *fp, Duration::ZERO, self.retain_for))
                .collect();
            let refs: Vec<&ClaimRequest> = reqs.iter().collect();
            let rows = self.store.upsert_round(conn, &refs, RecordState::Completed).await?;
            for (row, (key, fp)) in rows.into_iter().zip(chunk) {
                let mark = match row {
                    Some((true, _, _)) => Some(Mark::First),
                    Some((false, rec, now)) => crate::row::mark_of(rec, *fp, now),
                    None => None,
                };
                match mark {
                    Some(m) => out.push(m),
                    // Changed or purged under the upsert: decide it alone.
                    None => out.push(self.mark(conn, key, *fp).await?),
                }
            }
        }
        Ok(out)
    }

    /// Stores results with their markers, in the caller's transaction (one statement each).
    ///
    /// # Errors
    /// As [`set_result`](Self::set_result).
    pub async fn set_results(
        &self,
        conn: &mut MySqlConnection,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        for (key, result) in items {
            self.set_result(conn, key, result).await?;
        }
        Ok(())
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
            if let Some(mark) = crate::row::mark_of(rec, fingerprint, now) {
                return Ok(mark);
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

    /// One message on its own: opens a transaction, marks `key`, runs `writes` only if
    /// the mark is first (with the transaction, as a broker adapter's inbox handler gets it),
    /// stores their result (JSON) with the marker and commits. Any error rolls everything back,
    /// marker included.
    ///
    /// # Errors
    /// [`InboxError::Writes`] when `writes` fails, [`InboxError::Store`] otherwise.
    pub async fn process<T, E, F, Fut>(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> Result<InboxOutcome<T>, InboxError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(crate::Tx<sqlx::MySql>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        crate::inbox::process_one(self, key, fingerprint, writes).await
    }
}
