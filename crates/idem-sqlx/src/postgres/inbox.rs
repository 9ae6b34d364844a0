//! The transactional inbox on PostgreSQL: the dedup marker commits with the caller's writes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use std::collections::HashMap;

use idem_core::time::duration_micros;
use idem_core::{ClaimRequest, DedupKey, Fingerprint, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnection, PgPool};

use super::{PostgresStore, backend};
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
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
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

impl PostgresInbox {
    pub(super) fn new(store: PostgresStore, retain_for: Duration) -> Self {
        Self { store, retain_for }
    }

    /// The store's pool (where batch transactions begin).
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// How long markers are kept.
    pub fn retention(&self) -> Duration {
        self.retain_for
    }

    /// The store's startup check ([`PostgresStore::check`]), which a consumer's `build` runs: the
    /// markers' table must exist with its columns.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`](idem_core::StoreError::NotMigrated); backend errors.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        self.store.check().await
    }

    /// Marks distinct keys with one statement on the caller's connection (inside their
    /// transaction), taking the rows in key-hash order; answers in input order, each as
    /// [`mark`](Self::mark) would. A second statement reads the keys that were taken, only when
    /// there are any.
    ///
    /// # Errors
    /// Backend errors (the caller should roll back).
    pub async fn mark_many(
        &self,
        conn: &mut PgConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Mark>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.store;
        // One row per distinct key, in key-hash order (one lock order for every batch).
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&n| (items[n].0.hash().0, n));
        let mut first: HashMap<[u8; 32], usize> = HashMap::with_capacity(items.len());
        let (mut h, mut sc, mut id, mut fps) = (vec![], vec![], vec![], vec![]);
        for n in order {
            let (key, fp) = &items[n];
            let hash = key.hash().0;
            if first.contains_key(&hash) {
                continue;
            }
            first.insert(hash, n);
            h.push(hash.to_vec());
            sc.push(key.scope());
            id.push(key.id());
            fps.push(fp.map(|f| f.0.to_vec()));
        }
        let keep = vec![duration_micros(self.retain_for); h.len()];
        let won: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&s.sql.mark_many)))
            .bind(&h)
            .bind(&sc)
            .bind(&id)
            .bind(&fps)
            .bind(s.skew())
            .bind(&keep)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("mark_many", e))?;
        let won: std::collections::HashSet<Vec<u8>> = won.into_iter().collect();
        let mut found = HashMap::new();
        let taken: Vec<&[u8; 32]> = first.keys().filter(|k| !won.contains(&k[..])).collect();
        s.read_losers(conn, &taken, &mut found).await?;
        let mut out = Vec::with_capacity(items.len());
        for (n, (key, fp)) in items.iter().enumerate() {
            let hash = key.hash().0;
            let mark = if won.contains(&hash[..]) && first.get(&hash) == Some(&n) {
                Some(Mark::First)
            } else {
                found
                    .get(&hash)
                    .and_then(|(_, rec, now)| crate::row::mark_of(rec.clone(), *fp, *now))
            };
            match mark {
                Some(m) => out.push(m),
                // Claimable again by the time its record was read: decide it alone.
                None => out.push(self.mark(conn, key, *fp).await?),
            }
        }
        Ok(out)
    }

    /// Stores results with their markers in one statement, in the caller's transaction.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] for a result above 1 MiB (nothing is stored); backend errors.
    pub async fn set_results(
        &self,
        conn: &mut PgConnection,
        items: &[(DedupKey, Vec<u8>)],
    ) -> Result<(), StoreError> {
        let mut hashes = Vec::with_capacity(items.len());
        let mut results = Vec::with_capacity(items.len());
        for (key, result) in items {
            StoreError::check_len("result", result.len(), MAX_RESULT_BYTES)?;
            hashes.push(key.hash().0.to_vec());
            results.push(result.as_slice());
        }
        sqlx::query(AssertSqlSafe(Arc::clone(&self.store.sql.set_results)))
            .bind(&hashes)
            .bind(&results)
            // An array join: planned with its arrays each time (see complete_many).
            .persistent(false)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("set_results", e))?;
        Ok(())
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
        F: FnOnce(crate::Tx<sqlx::Postgres>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        crate::inbox::process_one(self, key, fingerprint, writes).await
    }
}
