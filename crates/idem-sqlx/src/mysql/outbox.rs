//! The outbox on MySQL/MariaDB: `FOR UPDATE SKIP LOCKED` leases (MySQL 8, MariaDB 10.6+).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{
    OutboxCounts, OutboxError, OutboxId, OutboxStore, Outgoing, Pending, PublishFailure, Ticket,
    UnsentRow,
};
use idem_core::time::{ClockSkew, duration_micros};
use idem_core::{Identifier, IdentifierError, StoreError};
use sqlx::mysql::MySqlPool;
use sqlx::{AssertSqlSafe, MySql, Row};

use super::{MAX_TABLE_NAME, MySqlStore, backend, is_duplicate_key};
use crate::outbox::{DEFAULT_OUTBOX_TABLE, Enqueue, counts_of, cut, pending_of, prepare};

/// "Now" by the server clock in microseconds, plus the test skew (bound as the next `?`).
const NOW: &str = "(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED) + ?)";

const COLUMNS: &str = "seq, token, CAST(failures AS SIGNED), CONVERT(message_id USING utf8mb4), \
     destination, payload, headers, ordering_key";

struct Sql {
    ddl: Vec<String>,
    t: String,
    enqueue: Arc<str>,
    candidates: Arc<str>,
    purge: Arc<str>,
    retry_parked: Arc<str>,
    failed: Arc<str>,
    counts: Arc<str>,
    unsent: Arc<str>,
}

impl Sql {
    fn new(table: &str) -> Self {
        let t = format!("`{table}`");
        // Binary collation: destinations and ordering keys compare by case. Ids are bytes: the
        // unique key must not merge `x` and `x ` (MariaDB's `utf8mb4_bin` pads spaces).
        let text = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin";
        let s = |x: String| -> Arc<str> { x.into() };
        Self {
            ddl: vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                   seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
                   message_id VARBINARY(255) NOT NULL, \
                   destination VARCHAR(255) {text} NOT NULL, \
                   ordering_key VARCHAR(255) {text} NULL, \
                   payload LONGBLOB NOT NULL, \
                   headers MEDIUMTEXT {text} NOT NULL, \
                   created_at BIGINT NOT NULL, \
                   state TINYINT NOT NULL DEFAULT 0, \
                   failures INT NOT NULL DEFAULT 0, \
                   due_at BIGINT NOT NULL, \
                   lease_until BIGINT NOT NULL DEFAULT 0, \
                   token BIGINT NOT NULL DEFAULT 0, \
                   sent_at BIGINT NULL, \
                   last_error TEXT {text} NULL, \
                   UNIQUE KEY `{table}_message_id` (message_id), \
                   KEY `{table}_state` (state, seq), \
                   KEY `{table}_ordering` (destination, ordering_key, seq), \
                   KEY `{table}_sent` (state, sent_at)\
                 ) ENGINE=InnoDB"
            )],
            // id, destination, ordering key, payload, headers, skew, skew.
            enqueue: s(format!(
                "INSERT INTO {t} (message_id, destination, ordering_key, payload, headers, created_at, due_at) \
                 VALUES (?, ?, ?, ?, ?, {NOW}, {NOW})"
            )),
            // skew, skew, limit. The ordering filter here only narrows the candidates; the
            // heads are checked again with a plain read (see `claim`).
            candidates: s(format!(
                "SELECT o.seq, o.destination, o.ordering_key FROM {t} o \
                 WHERE o.state = 0 AND o.due_at <= {NOW} AND o.lease_until <= {NOW} \
                   AND (o.ordering_key IS NULL OR NOT EXISTS (\
                        SELECT 1 FROM {t} p WHERE p.destination = o.destination \
                        AND p.ordering_key = o.ordering_key AND p.seq < o.seq AND p.state <> 1)) \
                 ORDER BY o.seq LIMIT ? FOR UPDATE SKIP LOCKED"
            )),
            // older than µs, skew, limit.
            purge: s(format!(
                "DELETE FROM {t} WHERE state = 1 AND sent_at <= {NOW} - ? ORDER BY sent_at LIMIT ?"
            )),
            // skew, limit.
            retry_parked: s(format!(
                "UPDATE {t} SET state = 0, failures = 0, due_at = {NOW} \
                 WHERE state = 2 ORDER BY seq LIMIT ?"
            )),
            // reason, retry µs, retry µs, skew, retry µs, seq, token.
            failed: s(format!(
                "UPDATE {t} SET failures = failures + 1, last_error = ?, lease_until = 0, \
                   token = token + 1, state = CASE WHEN ? IS NULL THEN 2 ELSE 0 END, \
                   due_at = {NOW} + COALESCE(?, 0) \
                 WHERE seq = ? AND token = ? AND state = 0"
            )),
            counts: s(format!("SELECT CAST(state AS SIGNED), COUNT(*) FROM {t} GROUP BY state")),
            // Parked (2) first, then pending (0), each in enqueue order.
            unsent: s(format!(
                "SELECT seq, CONVERT(message_id USING utf8mb4), destination, CAST(state AS SIGNED), \
                 CAST(failures AS SIGNED), last_error FROM {t} \
                 WHERE state IN (0, 2) ORDER BY state DESC, seq LIMIT ?"
            )),
            t,
        }
    }

    fn placeholders(n: usize, each: &str) -> String {
        vec![each; n].join(", ")
    }
}

/// The transactional outbox on MySQL/MariaDB: messages enqueued in the caller's transaction,
/// leased to relays with `FOR UPDATE SKIP LOCKED` (MySQL 8, MariaDB 10.6+).
///
/// ```no_run
/// use idem_core::outbox::Outgoing;
/// use idem_sqlx::MySqlStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// let outbox = store.outbox();
/// outbox.migrate().await?;
/// let mut tx = store.pool().begin().await?;
/// outbox.enqueue(&mut tx, Outgoing::new("orders.accepted", "o-1")).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    table: Identifier,
    sql: Arc<Sql>,
    skew: ClockSkew,
}

impl std::fmt::Debug for MySqlOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlOutbox").field("table", &self.table).finish_non_exhaustive()
    }
}

impl MySqlStore {
    /// The outbox beside this store: same pool and clock, table `idem_outbox`.
    pub fn outbox(&self) -> MySqlOutbox {
        let table =
            Identifier::new("outbox table name", DEFAULT_OUTBOX_TABLE).expect("default is valid");
        MySqlOutbox {
            pool: self.pool().clone(),
            sql: Arc::new(Sql::new(table.as_str())),
            table,
            skew: self.skew.clone(),
        }
    }
}

impl MySqlOutbox {
    /// Uses another table (letters, digits, `_`; at most 52 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        let table = Identifier::with_limit("outbox table name", name, MAX_TABLE_NAME)?;
        self.sql = Arc::new(Sql::new(table.as_str()));
        self.table = table;
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
    /// Cancel safe in effect: MySQL commits each DDL statement on its own, so a dropped call
    /// may leave part of it done; every statement is `IF NOT EXISTS`, so running it again
    /// finishes the job.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        for stmt in &self.sql.ddl {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&self.pool)
                .await
                .map_err(|e| backend("outbox migrate", e))?;
        }
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for users who own their migrations.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().map(|s| format!("{s};\n")).collect()
    }

    /// Enqueues `msg` on the caller's connection, inside their transaction: it is published
    /// only if that transaction commits. Returns its id (an id already in the outbox is left
    /// as it is: the same message; MySQL rolls back only the refused statement, so the
    /// transaction goes on).
    ///
    /// # Errors
    /// A field over its limit ([`OutboxError`] names it); backend errors (roll back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the caller's transaction commits.
    pub async fn enqueue(
        &self,
        to: &mut impl Enqueue<MySql>,
        msg: Outgoing,
    ) -> Result<OutboxId, OutboxError> {
        let m = prepare(to, msg)?;
        let skew = self.skew.micros();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.enqueue)))
            .bind(m.id().as_str())
            .bind(m.destination())
            .bind(m.ordering_key())
            .bind(m.payload())
            .bind(m.headers_json())
            .bind(skew)
            .bind(skew)
            .execute(to.connection())
            .await;
        match done {
            Ok(_) => Ok(m.id().clone()),
            Err(e) if is_duplicate_key(&e) => Ok(m.id().clone()),
            Err(e) => Err(backend("outbox enqueue", e).into()),
        }
    }

    /// The claim inside one transaction: lock candidates (`SKIP LOCKED`), keep the heads of
    /// their ordering keys (checked by a plain read, which sees rows other relays hold as
    /// unsent), lease them, read them back.
    async fn claim_in(
        &self,
        tx: &mut sqlx::MySqlConnection,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<sqlx::mysql::MySqlRow>, sqlx::Error> {
        let skew = self.skew.micros();
        let t = &self.sql.t;
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.candidates)))
            .bind(skew)
            .bind(skew)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        let mut seqs = Vec::with_capacity(rows.len());
        let mut ordered: Vec<(i64, String, String)> = Vec::new();
        for r in &rows {
            let seq: i64 = r.try_get(0)?;
            match r.try_get::<Option<String>, _>(2)? {
                Some(k) => ordered.push((seq, r.try_get(1)?, k)),
                None => seqs.push(seq),
            }
        }
        if !ordered.is_empty() {
            let sql = format!(
                "SELECT destination, ordering_key, MIN(seq) FROM {t} \
                 WHERE state <> 1 AND (destination, ordering_key) IN ({}) \
                 GROUP BY destination, ordering_key",
                Sql::placeholders(ordered.len(), "(?, ?)")
            );
            let mut q = sqlx::query(AssertSqlSafe(sql));
            for (_, d, k) in &ordered {
                q = q.bind(d).bind(k);
            }
            let heads: HashMap<(String, String), i64> = q
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| Ok(((r.try_get(0)?, r.try_get(1)?), r.try_get(2)?)))
                .collect::<Result<_, sqlx::Error>>()?;
            for (seq, d, k) in ordered {
                if heads.get(&(d, k)) == Some(&seq) {
                    seqs.push(seq);
                }
            }
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let list = Sql::placeholders(seqs.len(), "?");
        let lease_sql = format!(
            "UPDATE {t} SET lease_until = {NOW} + ?, token = token + 1 WHERE seq IN ({list})"
        );
        let mut q = sqlx::query(AssertSqlSafe(lease_sql)).bind(skew).bind(duration_micros(lease));
        for s in &seqs {
            q = q.bind(s);
        }
        q.execute(&mut *tx).await?;
        let read = format!("SELECT {COLUMNS} FROM {t} WHERE seq IN ({list}) ORDER BY seq");
        let mut q = sqlx::query(AssertSqlSafe(read));
        for s in &seqs {
            q = q.bind(s);
        }
        q.fetch_all(&mut *tx).await
    }
}

impl OutboxStore for MySqlOutbox {
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
        let mut tx = self.pool.begin().await.map_err(|e| backend("outbox claim", e))?;
        let rows =
            self.claim_in(&mut tx, limit, lease).await.map_err(|e| backend("outbox claim", e))?;
        tx.commit().await.map_err(|e| backend("outbox claim", e))?;
        pending_of(rows)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        if tickets.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "UPDATE {} SET state = 1, sent_at = {NOW}, lease_until = 0 \
             WHERE state = 0 AND seq IN ({}) AND (seq, token) IN ({})",
            self.sql.t,
            Sql::placeholders(tickets.len(), "?"),
            Sql::placeholders(tickets.len(), "(?, ?)")
        );
        let mut q = sqlx::query(AssertSqlSafe(sql)).bind(self.skew.micros());
        for t in tickets {
            q = q.bind(t.row);
        }
        for t in tickets {
            q = q.bind(t.row).bind(t.token);
        }
        let done = q.execute(&self.pool).await.map_err(|e| backend("outbox mark_sent", e))?;
        Ok(done.rows_affected())
    }

    async fn remove_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        if tickets.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "DELETE FROM {} WHERE state = 0 AND seq IN ({}) AND (seq, token) IN ({})",
            self.sql.t,
            Sql::placeholders(tickets.len(), "?"),
            Sql::placeholders(tickets.len(), "(?, ?)")
        );
        let mut q = sqlx::query(AssertSqlSafe(sql));
        for t in tickets {
            q = q.bind(t.row);
        }
        for t in tickets {
            q = q.bind(t.row).bind(t.token);
        }
        let done = q.execute(&self.pool).await.map_err(|e| backend("outbox remove_sent", e))?;
        Ok(done.rows_affected())
    }

    async fn mark_failed(&self, failures: &[PublishFailure]) -> Result<u64, StoreError> {
        if failures.is_empty() {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await.map_err(|e| backend("outbox mark_failed", e))?;
        let mut n = 0;
        for f in failures {
            let retry = f.retry_in.map(duration_micros);
            n += sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.failed)))
                .bind(cut(&f.reason))
                .bind(retry)
                .bind(self.skew.micros())
                .bind(retry)
                .bind(f.ticket.row)
                .bind(f.ticket.token)
                .execute(&mut *tx)
                .await
                .map_err(|e| backend("outbox mark_failed", e))?
                .rows_affected();
        }
        tx.commit().await.map_err(|e| backend("outbox mark_failed", e))?;
        Ok(n)
    }

    async fn purge_sent(&self, older_than: Duration, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(self.skew.micros())
            .bind(duration_micros(older_than))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox purge", e))?;
        Ok(done.rows_affected())
    }

    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.retry_parked)))
            .bind(self.skew.micros())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
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
