//! The transactional inbox on SQLite: the primitives of [`TxInbox`], in SQL.

use std::sync::Arc;
use std::time::Duration;

use idem_core::claim::next_token;
use idem_core::inbox::{Savepoint, TxInbox};
use idem_core::{Claim, DedupKey, Fingerprint, StoreError};
use sqlx::AssertSqlSafe;
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool};

use super::{SqliteStore, backend};
use crate::MAX_RESULT_BYTES;
use crate::row::{claim_of, i64_of, mark_lease};

/// Records dedup markers inside a SQLite transaction: the marker and the business writes commit
/// together, and a rollback leaves no marker. Transactions begin with `BEGIN IMMEDIATE`: a
/// concurrent transaction marking the same key waits on SQLite's write lock, then sees this
/// one's committed marker — or acquires if it rolled back (a deferred transaction that has read
/// first may fail with `SQLITE_BUSY` when it writes).
///
/// ```
/// use std::time::Duration;
/// use idem_core::{Claim, DedupKey, Fingerprint, inbox::TxInbox};
/// use idem_sqlx::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("shop.sqlite")).await?;
/// sqlx::query("CREATE TABLE orders (id TEXT, cents INTEGER)").execute(store.pool()).await?;
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let fp = Fingerprint::of_bytes(b"o-1:1200");
///
/// let mut tx = inbox.begin().await?; // BEGIN IMMEDIATE
/// if let Claim::Acquired(_) = inbox.mark(&mut tx, &key, Some(fp)).await? {
///     sqlx::query("INSERT INTO orders VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// inbox.commit(tx).await?; // then ack the message
///
/// let mut tx = inbox.begin().await?;
/// assert!(matches!(inbox.mark(&mut tx, &key, Some(fp)).await?, Claim::Completed(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteInbox {
    pub(super) store: SqliteStore,
    retain_for: Duration,
}

impl SqliteInbox {
    pub(super) fn new(store: SqliteStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// The store's pool (where batch transactions begin, with `BEGIN IMMEDIATE`).
    pub fn pool(&self) -> &SqlitePool {
        self.store.pool()
    }

    /// One key on its own: the marker's upsert, then — when it did not take the row — a read of
    /// what holds it, up to 8 times.
    async fn mark_alone(
        &self,
        conn: &mut SqliteConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim, StoreError> {
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
                return Ok(Claim::Acquired(mark_lease(key, fingerprint)));
            }
            let Some(rec) = s.fetch(conn, key).await? else { continue };
            if let Some(claim) = claim_of(rec, fingerprint, now) {
                return Ok(claim);
            }
        }
        Err(StoreError::backend("mark", true, "record kept changing under the mark (8 tries)"))
    }
}

impl TxInbox for SqliteInbox {
    type Transaction = sqlx::Transaction<'static, Sqlite>;
    type Connection = SqliteConnection;

    fn connection(tx: &mut Self::Transaction) -> &mut SqliteConnection {
        tx
    }

    fn connection_ref(tx: &Self::Transaction) -> &SqliteConnection {
        tx
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

    /// `BEGIN IMMEDIATE`: the write lock is taken up front.
    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        self.pool().begin_with("BEGIN IMMEDIATE").await.map_err(|e| backend("begin", e))
    }

    /// One multi-row upsert per 500 rows, in key-hash order, then one read of the keys it did
    /// not win.
    async fn mark_many(
        &self,
        conn: &mut SqliteConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Claim>, StoreError> {
        let mut out: Vec<Option<Claim>> = items.iter().map(|_| None).collect();
        // At most 500 rows (4,000 parameters) per statement.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].0.hash().0);
        order.dedup_by_key(|i| items[*i].0.hash().0);
        for chunk in order.chunks(500) {
            let s = &self.store;
            let now = s.now();
            let mut q =
                sqlx::query_scalar::<_, Vec<u8>>(AssertSqlSafe(s.sql.mark_many(chunk.len())));
            let token = i64_of(next_token(None, now), "token")?;
            let expiry = now.plus(self.retain_for).as_micros();
            for &i in chunk {
                let (key, fp) = &items[i];
                q = q
                    .bind(key.hash().0.to_vec())
                    .bind(key.scope())
                    .bind(key.id())
                    .bind(fp.as_ref().map(|f| &f.0[..]))
                    .bind(token)
                    .bind(now.as_micros())
                    .bind(now.as_micros())
                    .bind(expiry);
            }
            let won: std::collections::HashSet<Vec<u8>> = q
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| backend("mark_many", e))?
                .into_iter()
                .collect();
            let lost: Vec<usize> = chunk
                .iter()
                .copied()
                .filter(|&i| !won.contains(&items[i].0.hash().0[..]))
                .collect();
            for &i in chunk {
                if won.contains(&items[i].0.hash().0[..]) {
                    out[i] = Some(Claim::Acquired(mark_lease(&items[i].0, items[i].1)));
                }
            }
            if !lost.is_empty() {
                let hashes: Vec<[u8; 32]> = lost.iter().map(|&i| items[i].0.hash().0).collect();
                let mut recs = s.records(conn, &hashes, "mark_many").await?;
                for i in lost {
                    let (key, fp) = &items[i];
                    let mark = recs.remove(&key.hash().0).and_then(|r| claim_of(r, *fp, now));
                    // Claimable again, or purged, by the time it was read: decide it alone.
                    out[i] = Some(match mark {
                        Some(m) => m,
                        None => self.mark_alone(conn, key, *fp).await?,
                    });
                }
            }
        }
        // A key given twice answers as its first copy's mark would for a second one.
        for (i, (key, fp)) in items.iter().enumerate() {
            if out[i].is_none() {
                out[i] = Some(self.mark_alone(conn, key, *fp).await?);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// One statement per result.
    async fn set_results(
        &self,
        conn: &mut SqliteConnection,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        for (key, result) in items {
            StoreError::check_len("result", result.len(), MAX_RESULT_BYTES)?;
            sqlx::query(AssertSqlSafe(Arc::clone(&self.store.sql.set_result)))
                .bind(&key.hash().0[..])
                .bind(result.as_slice())
                .execute(&mut *conn)
                .await
                .map_err(|e| backend("set_result", e))?;
        }
        Ok(())
    }

    /// SQLite takes several statements in one call.
    async fn savepoint(
        &self,
        conn: &mut SqliteConnection,
        step: Savepoint,
    ) -> Result<(), StoreError> {
        sqlx::raw_sql(step.sql()).execute(conn).await.map(drop).map_err(|e| backend("savepoint", e))
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<Option<Vec<Claim>>, StoreError> {
        tx.commit().await.map(|()| None).map_err(|e| backend("commit", e))
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.rollback().await.map_err(|e| backend("rollback", e))
    }
}
