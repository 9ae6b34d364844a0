//! The transactional inbox on MySQL / MariaDB: the primitives of [`TxInbox`], in SQL.

use std::time::Duration;

use idem_core::inbox::{Savepoint, TxInbox};
use idem_core::time::duration_micros;
use idem_core::{Claim, ClaimRequest, DedupKey, Fingerprint, RecordState, StoreError};
use sqlx::mysql::{MySql, MySqlConnection, MySqlPool};

use super::{MySqlStore, backend, error_number, nonce};
use crate::MAX_RESULT_BYTES;
use crate::row::{claim_of, mark_lease};

/// Records dedup markers inside a MySQL/MariaDB transaction: the marker and the business
/// writes commit together, and a rollback leaves no marker.
///
/// A mark is a plain `INSERT`: a duplicate key (error 1062) only fails that statement, never
/// the caller's transaction, and is read back (locking read) as completed, a conflict or in
/// progress. It is not `INSERT IGNORE` (which would truncate and hide errors) and not
/// `ON DUPLICATE KEY UPDATE` (which cannot tell an insert from a duplicate here). A second
/// transaction marking the same key waits on the first's row lock, then sees it completed — or
/// acquires if the first rolled back. A deadlock (1213) rolls back the caller's whole
/// transaction; it is reported as a retryable error: run the transaction again.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, DedupKey, inbox::TxInbox};
/// use idem_sqlx::MySqlStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let mut tx = store.pool().begin().await?;
/// if let Claim::Acquired(_) = inbox.mark(&mut tx, &key, None).await? {
///     sqlx::query("INSERT INTO orders (id, cents) VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// tx.commit().await?; // then ack the message
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlInbox {
    pub(super) store: MySqlStore,
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

    /// One key on its own: the marker's `INSERT`, a takeover of an expired or released one, or
    /// a locking read of what holds it, up to 8 times.
    async fn mark_alone(
        &self,
        conn: &mut MySqlConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim, StoreError> {
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
                Ok(_) => return Ok(Claim::Acquired(mark_lease(key, fingerprint))),
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
                return Ok(Claim::Acquired(mark_lease(key, fingerprint)));
            }
            let Some((rec, now)) = s.fetch(conn, key, true).await? else { continue };
            if let Some(claim) = claim_of(rec, fingerprint, now) {
                return Ok(claim);
            }
        }
        Err(StoreError::backend("mark", true, "record kept changing under the mark (8 tries)"))
    }
}

impl TxInbox for MySqlInbox {
    type Transaction = sqlx::Transaction<'static, MySql>;
    type Connection = MySqlConnection;

    fn connection(tx: &mut Self::Transaction) -> &mut MySqlConnection {
        tx
    }

    fn connection_ref(tx: &Self::Transaction) -> &MySqlConnection {
        tx
    }

    fn is_serialization_failure(e: &StoreError) -> bool {
        crate::serialization::store_error_is_serialization_failure(e)
    }

    /// The store itself: notes live in the markers' table.
    fn crash_note_store(&self) -> Option<&impl idem_core::DedupStore> {
        Some(&self.store)
    }

    fn retention(&self) -> Duration {
        self.retain_for
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        self.store.check().await
    }

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        self.pool().begin().await.map_err(|e| backend("begin", e))
    }

    /// One upsert per chunk of rows, in key-hash order, then one locking read of the rows.
    async fn mark_many(
        &self,
        conn: &mut MySqlConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Claim>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(super::MAX_ROWS) {
            let reqs: Vec<ClaimRequest> = chunk
                .iter()
                .map(|(k, fp)| ClaimRequest::new(k.clone(), *fp, Duration::ZERO, self.retain_for))
                .collect();
            let refs: Vec<&ClaimRequest> = reqs.iter().collect();
            let rows = self.store.upsert_round(conn, &refs, RecordState::Completed, true).await?;
            for (row, (key, fp)) in rows.into_iter().zip(chunk) {
                let claim = match row {
                    Some((true, _, _)) => Some(Claim::Acquired(mark_lease(key, *fp))),
                    Some((false, rec, now)) => claim_of(rec, *fp, now),
                    None => None,
                };
                match claim {
                    Some(c) => out.push(c),
                    // Changed or purged under the upsert: decide it alone.
                    None => out.push(self.mark_alone(conn, key, *fp).await?),
                }
            }
        }
        Ok(out)
    }

    /// One statement per result.
    async fn set_results(
        &self,
        conn: &mut MySqlConnection,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        for (key, result) in items {
            StoreError::check_len("result", result.len(), MAX_RESULT_BYTES)?;
            let b =
                self.store.binds().bytes("hash", Some(&key.hash().0)).bytes("result", Some(result));
            self.store
                .sql
                .set_result
                .query(&b)
                .execute(&mut *conn)
                .await
                .map_err(|e| backend("set_result", e))?;
        }
        Ok(())
    }

    /// MySQL takes one statement per round trip: a release-and-set is two.
    async fn savepoint(
        &self,
        conn: &mut MySqlConnection,
        step: Savepoint,
    ) -> Result<(), StoreError> {
        let run = |sql: &'static str| sqlx::raw_sql(sql);
        for sql in step.sql().split("; ") {
            run(sql).execute(&mut *conn).await.map_err(|e| backend("savepoint", e))?;
        }
        Ok(())
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<Option<Vec<Claim>>, StoreError> {
        tx.commit().await.map(|()| None).map_err(|e| backend("commit", e))
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.rollback().await.map_err(|e| backend("rollback", e))
    }
}
