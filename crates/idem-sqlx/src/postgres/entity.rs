//! Entity as marker: the business row keyed by its business id is the dedup record.

use std::sync::Arc;

use idem_core::{Claim, DedupKey, Fingerprint, Identifier, IdentifierError, Record, StoreError};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use super::backend;

/// A business table whose primary key is the business id (an orders table keyed by order id)
/// and which stores the payload fingerprint in a `bytea` column. Its unique key is the marker:
/// no separate dedup record is needed.
///
/// Insert with `ON CONFLICT (<id>) DO NOTHING` (never an error inside your transaction), then
/// hand the number of inserted rows to [`EntityTable::classify`].
///
/// ```no_run
/// use idem_core::{Claim, DedupKey, Fingerprint};
/// use idem_sqlx::postgres::EntityTable;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let orders = EntityTable::new("public", "orders", "order_id", "fingerprint")?;
/// let key = DedupKey::new("order-writer", "o-1")?;
/// let fp = Fingerprint::of_bytes(b"o-1:1200");
/// let mut tx = pool.begin().await?;
/// let done = sqlx::query(
///     "INSERT INTO orders (order_id, fingerprint, cents) VALUES ($1, $2, $3) \
///      ON CONFLICT (order_id) DO NOTHING")
///     .bind("o-1").bind(&fp.0[..]).bind(1200_i64)
///     .execute(&mut *tx).await?;
/// match orders.classify(&mut tx, done.rows_affected(), &key, fp).await? {
///     Claim::Acquired(_) => { /* the rest of the effect, same transaction */ }
///     Claim::Completed(_) => { /* a duplicate: ack */ }
///     Claim::Conflict(_) => { /* dead-letter with the reason */ }
///     Claim::InProgress { .. } => unreachable!("an entity row is never leased"),
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct EntityTable {
    select: Arc<str>,
}

impl EntityTable {
    /// Names the table and its id and fingerprint columns (validated identifiers).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the bad name.
    pub fn new(
        schema: &str,
        table: &str,
        id_column: &str,
        fingerprint_column: &str,
    ) -> Result<Self, IdentifierError> {
        let schema = Identifier::new("schema name", schema)?;
        let table = Identifier::new("table name", table)?;
        let id = Identifier::new("id column", id_column)?;
        let fp = Identifier::new("fingerprint column", fingerprint_column)?;
        Ok(Self {
            select: format!("SELECT \"{fp}\" FROM \"{schema}\".\"{table}\" WHERE \"{id}\" = $1")
                .into(),
        })
    }

    /// Decides the delivery of `key` after your `INSERT … ON CONFLICT DO NOTHING` of the row
    /// whose id is `key.id()` inserted `inserted` rows: 1 → [`Claim::Acquired`] (this delivery
    /// created it); 0 → the stored fingerprint decides between [`Claim::Completed`] (a
    /// duplicate) and [`Claim::Conflict`] (the id reused for other content), each with the row
    /// as a [`Record::entity`]. Runs on your transaction's connection; never answers
    /// [`Claim::InProgress`].
    ///
    /// # Errors
    /// Backend errors; [`StoreError::Corrupt`] when the conflicting row cannot be found.
    ///
    /// # Cancel safety
    /// Cancel safe (it reads, on the caller's transaction).
    pub async fn classify(
        &self,
        conn: &mut PgConnection,
        inserted: u64,
        key: &DedupKey,
        fingerprint: Fingerprint,
    ) -> Result<Claim, StoreError> {
        if inserted > 0 {
            return Ok(Claim::Acquired(crate::row::mark_lease(key, Some(fingerprint))));
        }
        let id = key.id();
        let stored: Option<Option<Vec<u8>>> =
            sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.select)))
                .bind(id)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| backend("entity", e))?;
        let Some(stored) = stored else {
            return Err(StoreError::Corrupt {
                what: format!("insert of {id} conflicted but no row with that id is visible"),
            });
        };
        let stored = stored.map(|b| Fingerprint::from_slice(&b)).transpose().map_err(|n| {
            StoreError::Corrupt { what: format!("stored fingerprint of {n} bytes") }
        })?;
        let rec = Record::entity(key, stored);
        Ok(if stored == Some(fingerprint) { Claim::Completed(rec) } else { Claim::Conflict(rec) })
    }
}
