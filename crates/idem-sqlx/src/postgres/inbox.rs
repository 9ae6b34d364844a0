//! The transactional inbox on PostgreSQL: the primitives of [`TxInbox`], in SQL.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use idem_core::inbox::{Savepoint, TxInbox};
use idem_core::time::duration_micros;
use idem_core::{Claim, ClaimRequest, DedupKey, Fingerprint, StoreError};
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnection, PgPool, Postgres};

use super::{PostgresStore, backend};
use crate::MAX_RESULT_BYTES;
use crate::row::{claim_of, mark_lease};

/// Records dedup markers inside a PostgreSQL transaction: the marker and the business writes
/// commit together, and a rollback leaves no marker. A consumer runs each batch through one
/// transaction (`Consumer::builder(source).inbox(store.inbox(retain))`); a caller with a
/// transaction of its own marks with [`TxInbox::mark`] inside it.
///
/// A mark never raises an error inside the caller's transaction: it is one
/// `INSERT … ON CONFLICT DO UPDATE … WHERE <expired or released>` that, on an existing live
/// marker, changes nothing and returns no row; the existing row is then read. (A unique
/// violation would abort the whole transaction.) A second transaction marking the same key
/// waits for the first on the row lock, then sees it completed if it committed, or acquires if
/// it rolled back. Use the default `READ COMMITTED` isolation: under `REPEATABLE READ` that
/// concurrent duplicate surfaces as a serialization failure (retryable) instead.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, DedupKey, Fingerprint, inbox::TxInbox};
/// use idem_sqlx::PostgresStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
/// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let mut tx = store.pool().begin().await?;
/// let claim = inbox.mark(&mut tx, &key, Some(Fingerprint::of_bytes(b"o-1:1200"))).await?;
/// if let Claim::Acquired(_) = claim {
///     sqlx::query("INSERT INTO orders (id, cents) VALUES ('o-1', 1200)").execute(&mut *tx).await?;
/// }
/// tx.commit().await?; // then ack the message
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresInbox {
    pub(super) store: PostgresStore,
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

    /// One key, marked again after its record was read claimable: the mark's upsert, then —
    /// when it did not take the row — a read of what holds it, up to 8 times.
    async fn mark_alone(
        &self,
        conn: &mut PgConnection,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let s = &self.store;
        let req = ClaimRequest::new(key.clone(), fingerprint, Duration::ZERO, self.retain_for);
        for _ in 0..8 {
            if s.upsert(conn, &s.sql.mark, &req, None).await?.is_some() {
                return Ok(Claim::Acquired(mark_lease(key, fingerprint)));
            }
            let Some((rec, now)) = s.fetch(conn, key).await? else { continue };
            if let Some(claim) = claim_of(rec, fingerprint, now) {
                return Ok(claim);
            }
        }
        Err(StoreError::backend("mark", true, "record kept changing under the mark (8 tries)"))
    }
}

impl TxInbox for PostgresInbox {
    type Transaction = sqlx::Transaction<'static, Postgres>;
    type Connection = PgConnection;

    fn connection(tx: &mut Self::Transaction) -> &mut PgConnection {
        tx
    }

    fn connection_ref(tx: &Self::Transaction) -> &PgConnection {
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

    /// One statement marks the batch, taking rows in key-hash order; a second reads the keys
    /// that were taken, only when there are any.
    async fn mark_many(
        &self,
        conn: &mut PgConnection,
        items: &[(DedupKey, Option<Fingerprint>)],
    ) -> Result<Vec<Claim>, StoreError> {
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
        let won: HashSet<Vec<u8>> = won.into_iter().collect();
        let mut found = HashMap::new();
        let taken: Vec<&[u8; 32]> = first.keys().filter(|k| !won.contains(&k[..])).collect();
        s.read_losers(conn, &taken, &mut found).await?;
        let mut out = Vec::with_capacity(items.len());
        for (n, (key, fp)) in items.iter().enumerate() {
            let hash = key.hash().0;
            let claim = if won.contains(&hash[..]) && first.get(&hash) == Some(&n) {
                Some(Claim::Acquired(mark_lease(key, *fp)))
            } else {
                found.get(&hash).and_then(|(_, rec, now)| claim_of(rec.clone(), *fp, *now))
            };
            match claim {
                Some(c) => out.push(c),
                // Claimable again by the time its record was read: decide it alone.
                None => out.push(self.mark_alone(conn, key, *fp).await?),
            }
        }
        Ok(out)
    }

    /// One statement for the batch's results.
    async fn set_results(
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

    async fn savepoint(&self, conn: &mut PgConnection, step: Savepoint) -> Result<(), StoreError> {
        // Several statements in one round trip: PostgreSQL's simple query protocol takes them.
        sqlx::raw_sql(step.sql()).execute(conn).await.map(drop).map_err(|e| backend("savepoint", e))
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<Option<Vec<Claim>>, StoreError> {
        tx.commit().await.map(|()| None).map_err(|e| backend("commit", e))
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.rollback().await.map_err(|e| backend("rollback", e))
    }
}
