//! The outbox on SQLite: leases under the database's single write lock.

use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{
    OutboxCounts, OutboxError, OutboxId, OutboxStore, Outgoing, Pending, PublishFailure, Ticket,
    UnsentRow,
};
use idem_core::time::{Clock, duration_micros};
use idem_core::{Identifier, IdentifierError, StoreError};
use sqlx::sqlite::SqlitePool;
use sqlx::{AssertSqlSafe, Sqlite};

use super::{SqliteStore, backend};
use crate::outbox::{DEFAULT_OUTBOX_TABLE, Enqueue, counts_of, cut, pending_of, prepare};

struct Sql {
    ddl: Vec<String>,
    enqueue: Arc<str>,
    claim: Arc<str>,
    sent: Arc<str>,
    remove: Arc<str>,
    failed: Arc<str>,
    purge: Arc<str>,
    retry_parked: Arc<str>,
    counts: Arc<str>,
    unsent: Arc<str>,
}

impl Sql {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let s = |x: String| -> Arc<str> { x.into() };
        Self {
            ddl: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                       seq INTEGER PRIMARY KEY AUTOINCREMENT, \
                       message_id TEXT NOT NULL UNIQUE, \
                       destination TEXT NOT NULL, \
                       ordering_key TEXT, \
                       payload BLOB NOT NULL, \
                       headers TEXT NOT NULL, \
                       created_at INTEGER NOT NULL, \
                       state INTEGER NOT NULL DEFAULT 0, \
                       failures INTEGER NOT NULL DEFAULT 0, \
                       due_at INTEGER NOT NULL, \
                       lease_until INTEGER NOT NULL DEFAULT 0, \
                       token INTEGER NOT NULL DEFAULT 0, \
                       sent_at INTEGER, \
                       last_error TEXT)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_unsent\" ON {t} (seq) WHERE state <> 1"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_ordering\" ON {t} \
                     (destination, ordering_key, seq) WHERE state <> 1 AND ordering_key IS NOT NULL"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_sent\" ON {t} (sent_at) WHERE state = 1"
                ),
            ],
            // ?1 id, ?2 destination, ?3 ordering key, ?4 payload, ?5 headers, ?6 now.
            enqueue: s(format!(
                "INSERT INTO {t} (message_id, destination, ordering_key, payload, headers, created_at, due_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6) ON CONFLICT (message_id) DO NOTHING"
            )),
            // ?1 limit, ?2 lease µs, ?3 now. One statement under the write lock: atomic.
            claim: s(format!(
                "UPDATE {t} SET lease_until = ?3 + ?2, token = token + 1 \
                 WHERE seq IN (SELECT o.seq FROM {t} o \
                   WHERE o.state = 0 AND o.due_at <= ?3 AND o.lease_until <= ?3 \
                     AND (o.ordering_key IS NULL OR NOT EXISTS (\
                          SELECT 1 FROM {t} p WHERE p.destination = o.destination \
                          AND p.ordering_key = o.ordering_key AND p.seq < o.seq AND p.state <> 1)) \
                   ORDER BY o.seq LIMIT ?1) \
                 RETURNING seq, token, failures, message_id, destination, payload, headers, ordering_key"
            )),
            // ?1 seq, ?2 token, ?3 now.
            sent: s(format!(
                "UPDATE {t} SET state = 1, sent_at = ?3, lease_until = 0 \
                 WHERE seq = ?1 AND token = ?2 AND state = 0"
            )),
            // ?1 seq, ?2 token.
            remove: s(format!("DELETE FROM {t} WHERE seq = ?1 AND token = ?2 AND state = 0")),
            // ?1 seq, ?2 token, ?3 reason, ?4 retry µs (NULL parks), ?5 now.
            failed: s(format!(
                "UPDATE {t} SET failures = failures + 1, last_error = ?3, lease_until = 0, \
                   token = token + 1, state = CASE WHEN ?4 IS NULL THEN 2 ELSE 0 END, \
                   due_at = ?5 + COALESCE(?4, 0) \
                 WHERE seq = ?1 AND token = ?2 AND state = 0"
            )),
            // ?1 older than µs, ?2 limit, ?3 now.
            purge: s(format!(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 1 \
                 AND sent_at <= ?3 - ?1 ORDER BY sent_at LIMIT ?2)"
            )),
            // ?1 limit, ?2 now.
            retry_parked: s(format!(
                "UPDATE {t} SET state = 0, failures = 0, due_at = ?2 \
                 WHERE seq IN (SELECT seq FROM {t} WHERE state = 2 ORDER BY seq LIMIT ?1)"
            )),
            counts: s(format!("SELECT state, count(*) FROM {t} GROUP BY state")),
            // Parked (2) first, then pending (0), each in enqueue order.
            unsent: s(format!(
                "SELECT seq, message_id, destination, state, failures, last_error FROM {t} \
                 WHERE state IN (0, 2) ORDER BY state DESC, seq LIMIT ?1"
            )),
        }
    }
}

/// The transactional outbox on SQLite: messages enqueued in the caller's transaction, leased
/// to relays by one `UPDATE … RETURNING` under SQLite's write lock. Times come from the
/// store's [`Clock`].
///
/// ```
/// use idem_core::outbox::{OutboxStore, Outgoing};
/// use idem_sqlx::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
/// let outbox = store.outbox();
/// outbox.migrate().await?;
/// let mut tx = store.pool().begin().await?;
/// let id = outbox.enqueue(&mut tx, Outgoing::new("orders.accepted", "o-1")).await?;
/// tx.commit().await?;
/// assert_eq!(outbox.counts().await?.pending, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    table: Identifier,
    sql: Arc<Sql>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteOutbox").field("table", &self.table).finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// The outbox beside this store: same pool and clock, table `idem_outbox`.
    pub fn outbox(&self) -> SqliteOutbox {
        let table =
            Identifier::new("outbox table name", DEFAULT_OUTBOX_TABLE).expect("default is valid");
        SqliteOutbox {
            pool: self.pool().clone(),
            sql: Arc::new(Sql::new(table.as_str())),
            table,
            clock: Arc::clone(&self.clock),
        }
    }
}

impl SqliteOutbox {
    /// Uses another table (letters, digits, `_`; at most 63 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        self.table = Identifier::new("outbox table name", name)?;
        self.sql = Arc::new(Sql::new(self.table.as_str()));
        Ok(self)
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// Creates the table and its indexes if missing (idempotent).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: each statement commits on its own and is `IF NOT EXISTS`, so
    /// running it again after a dropped call finishes the job.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        super::execute_ddl(&self.pool, &self.sql.ddl)
            .await
            .map_err(|e| backend("outbox migrate", e))
    }

    /// The DDL [`migrate`](Self::migrate) runs, for users who own their migrations.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().map(|s| format!("{s};\n")).collect()
    }

    /// Enqueues `msg` on the caller's connection, inside their transaction: it is published
    /// only if that transaction commits. Returns its id (an id already in the outbox is left
    /// as it is: the same message).
    ///
    /// # Errors
    /// A field over its limit ([`OutboxError`] names it); backend errors (roll back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the caller's transaction commits.
    pub async fn enqueue(
        &self,
        to: &mut impl Enqueue<Sqlite>,
        msg: Outgoing,
    ) -> Result<OutboxId, OutboxError> {
        let m = prepare(to, msg)?;
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.enqueue)))
            .bind(m.id().as_str())
            .bind(m.destination())
            .bind(m.ordering_key())
            .bind(m.payload())
            .bind(m.headers_json())
            .bind(self.clock.now().as_micros())
            .execute(to.connection())
            .await
            .map_err(|e| backend("outbox enqueue", e))?;
        Ok(m.id().clone())
    }

    fn now(&self) -> i64 {
        self.clock.now().as_micros()
    }

    fn stmt(&self, sql: &Arc<str>) -> Query {
        sqlx::query(AssertSqlSafe(Arc::clone(sql)))
    }

    /// Runs `statements` in one transaction (one fsync); returns the rows they changed.
    async fn each_in_tx(
        &self,
        op: &'static str,
        statements: Vec<Query>,
    ) -> Result<u64, StoreError> {
        if statements.is_empty() {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await.map_err(|e| backend(op, e))?;
        let mut n = 0;
        for q in statements {
            n += q.execute(&mut *tx).await.map_err(|e| backend(op, e))?.rows_affected();
        }
        tx.commit().await.map_err(|e| backend(op, e))?;
        Ok(n)
    }
}

type Query = sqlx::query::Query<'static, Sqlite, <Sqlite as sqlx::Database>::Arguments>;

impl OutboxStore for SqliteOutbox {
    async fn send(&self, messages: Vec<Outgoing>) -> Result<Vec<OutboxId>, OutboxError> {
        let mut tx = self.pool.begin().await.map_err(|e| backend("outbox send", e))?;
        let mut ids = Vec::with_capacity(messages.len());
        for m in messages {
            ids.push(self.enqueue(&mut tx, m).await?);
        }
        tx.commit().await.map_err(|e| backend("outbox send", e))?;
        Ok(ids)
    }

    async fn claim(&self, limit: usize, lease: Duration) -> Result<Vec<Pending>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim)))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(duration_micros(lease))
            .bind(self.now())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("outbox claim", e))?;
        pending_of(rows)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let now = self.now();
        let stmt = |t: &Ticket| self.stmt(&self.sql.sent).bind(t.row).bind(t.token).bind(now);
        self.each_in_tx("outbox mark_sent", tickets.iter().map(stmt).collect()).await
    }

    async fn remove_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let stmt = |t: &Ticket| self.stmt(&self.sql.remove).bind(t.row).bind(t.token);
        self.each_in_tx("outbox remove_sent", tickets.iter().map(stmt).collect()).await
    }

    async fn mark_failed(&self, failures: &[PublishFailure]) -> Result<u64, StoreError> {
        let now = self.now();
        let stmt = |f: &PublishFailure| {
            self.stmt(&self.sql.failed)
                .bind(f.ticket.row)
                .bind(f.ticket.token)
                .bind(cut(&f.reason).to_owned())
                .bind(f.retry_in.map(duration_micros))
                .bind(now)
        };
        self.each_in_tx("outbox mark_failed", failures.iter().map(stmt).collect()).await
    }

    async fn purge_sent(&self, older_than: Duration, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(duration_micros(older_than))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(self.now())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox purge", e))?;
        Ok(done.rows_affected())
    }

    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.retry_parked)))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(self.now())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox retry_parked", e))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        let rows: Vec<(i64, i64)> = sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.counts)))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("outbox counts", e))?;
        counts_of(rows)
    }

    async fn unsent(&self, limit: usize) -> Result<Vec<UnsentRow>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(i64, String, String, i64, i64, Option<String>)> =
            sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.unsent)))
                .bind(limit)
                .fetch_all(&self.pool)
                .await
                .map_err(|e| backend("outbox unsent", e))?;
        Ok(crate::outbox::unsent_of(rows))
    }
}
