//! Entity as marker (R5): the business row keyed by its business id is the dedup record.

use std::sync::Arc;

use idem_core::{Fingerprint, Identifier, IdentifierError, StoreError};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use super::backend;

/// What inserting a business row keyed by its business id found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "a conflict must be reported (dead-lettered), never dropped"]
pub enum EntityMark {
    /// The row is new: this delivery created it.
    Inserted,
    /// The row exists with the same fingerprint: a duplicate delivery.
    Duplicate,
    /// The row exists with another fingerprint (or none): the id was reused for different
    /// content.
    Conflict {
        /// The stored fingerprint.
        stored: Option<Fingerprint>,
    },
}

/// A business table whose primary key is the business id (an orders table keyed by order id)
/// and which stores the payload fingerprint in a `bytea` column. Its unique key is the marker:
/// no separate dedup record is needed.
///
/// Insert with `ON CONFLICT (<id>) DO NOTHING` (never an error inside your transaction), then
/// hand the number of inserted rows to [`EntityTable::classify`].
///
/// ```no_run
/// use idem_core::Fingerprint;
/// use idem_sqlx::postgres::{EntityMark, EntityTable};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let orders = EntityTable::new("public", "orders", "order_id", "fingerprint")?;
/// let fp = Fingerprint::of_bytes(b"o-1:1200");
/// let mut tx = pool.begin().await?;
/// let done = sqlx::query(
///     "INSERT INTO orders (order_id, fingerprint, cents) VALUES ($1, $2, $3) \
///      ON CONFLICT (order_id) DO NOTHING")
///     .bind("o-1").bind(&fp.0[..]).bind(1200_i64)
///     .execute(&mut *tx).await?;
/// match orders.classify(&mut tx, done.rows_affected(), "o-1", fp).await? {
///     EntityMark::Inserted => { /* the rest of the effect, same transaction */ }
///     EntityMark::Duplicate => { /* ack */ }
///     EntityMark::Conflict { .. } => { /* dead-letter with the reason */ }
///     _ => {}
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

    /// Decides the delivery after your `INSERT … ON CONFLICT DO NOTHING` inserted `inserted`
    /// rows: 1 → [`EntityMark::Inserted`]; 0 → the stored fingerprint decides between duplicate
    /// and conflict. Runs on your transaction's connection.
    ///
    /// # Errors
    /// Backend errors; [`StoreError::Corrupt`] when the conflicting row cannot be found.
    pub async fn classify(
        &self,
        conn: &mut PgConnection,
        inserted: u64,
        id: &str,
        fingerprint: Fingerprint,
    ) -> Result<EntityMark, StoreError> {
        if inserted > 0 {
            return Ok(EntityMark::Inserted);
        }
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
        Ok(if stored == Some(fingerprint) {
            EntityMark::Duplicate
        } else {
            EntityMark::Conflict { stored }
        })
    }
}
