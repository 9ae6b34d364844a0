//! The transactional inbox on SQLite: the dedup marker commits with the caller's writes.

use std::future::Future;
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

impl SqliteInbox {
    pub(super) fn new(store: SqliteStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// The store's pool (where batch transactions begin, with `BEGIN IMMEDIATE`).
    pub fn pool(&self) -> &SqlitePool {
        self.store.pool()
    }

    /// How long markers are kept.
    pub fn retention(&self) -> Duration {
        self.retain_for
    }

    /// The store's startup check ([`SqliteStore::check`]), which a consumer's `build` runs: the
    /// markers' table must exist with its columns.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`](idem_core::StoreError::NotMigrated); backend errors.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        self.store.check().await
    }

    /// Marks distinct keys on the caller's connection with one multi-row upsert, rows in
    /// key-hash order, then one read of the keys it did not win; answers in input order, each as
    /// [`mark`](Self::mark) would.
    ///
    /// # Errors
    /// Backend errors (the caller should roll back).
    pub async fn mark_many(
        &self,
        conn: &mut SqliteConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Mark>, StoreError> {
        let mut out: Vec<Option<Mark>> = items.iter().map(|_| None).collect();
        // At most 500 rows (2,000 parameters) per statement.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].0.hash().0);
        order.dedup_by_key(|i| items[*i].0.hash().0);
        for chunk in order.chunks(500) {
            let s = &self.store;
            let now = s.now();
            let mut q =
                sqlx::query_scalar::<_, Vec<u8>>(AssertSqlSafe(s.sql.mark_many(chunk.len())))
                    .bind(now.as_micros())
                    .bind(now.plus(self.retain_for).as_micros())
                    .bind(i64_of(next_token(None, now), "token")?);
            for &i in chunk {
                let (key, fp) = &items[i];
                q = q
                    .bind(key.hash().0.to_vec())
                    .bind(key.scope())
                    .bind(key.id())
                    .bind(fp.as_ref().map(|f| &f.0[..]));
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
                    out[i] = Some(Mark::First);
                }
            }
            if !lost.is_empty() {
                let mut sel = sqlx::query(AssertSqlSafe(s.sql.select_many(lost.len())));
                for &i in &lost {
                    sel = sel.bind(items[i].0.hash().0.to_vec());
                }
                let rows = sel.fetch_all(&mut *conn).await.map_err(|e| backend("mark_many", e))?;
                let mut recs = std::collections::HashMap::new();
                for row in &rows {
                    let rec = crate::row::decode_row(row)?;
                    recs.insert(rec.key_hash.0, rec);
                }
                for i in lost {
                    let (key, fp) = &items[i];
                    let mark =
                        recs.remove(&key.hash().0).and_then(|r| crate::row::mark_of(r, *fp, now));
                    // Claimable again, or purged, by the time it was read: decide it alone.
                    out[i] = Some(match mark {
                        Some(m) => m,
                        None => self.mark(conn, key, *fp).await?,
                    });
                }
            }
        }
        // A key given twice answers as its first copy's mark would for a second one.
        for (i, (key, fp)) in items.iter().enumerate() {
            if out[i].is_none() {
                out[i] = Some(self.mark(conn, key, *fp).await?);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Stores results with their markers, in the caller's transaction.
    ///
    /// # Errors
    /// As [`set_result`](Self::set_result).
    pub async fn set_results(
        &self,
        conn: &mut SqliteConnection,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        for (key, result) in items {
            self.set_result(conn, key, result).await?;
        }
        Ok(())
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
            if let Some(mark) = crate::row::mark_of(rec, fingerprint, now) {
                return Ok(mark);
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

    /// One message on its own: opens a `BEGIN IMMEDIATE` transaction, marks `key`, runs `writes` only if
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
        F: FnOnce(crate::Tx<sqlx::Sqlite>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        crate::inbox::process_one(self, key, fingerprint, writes).await
    }
}
