//! The outbox on PostgreSQL: `FOR UPDATE SKIP LOCKED` leases and `LISTEN/NOTIFY` wake-ups.

use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{
    OutboxCounts, OutboxError, OutboxId, OutboxStore, Outgoing, Pending, PublishFailure, Ticket,
    UnsentRow,
};
use idem_core::time::{ClockSkew, duration_micros};
use idem_core::{Identifier, IdentifierError, StoreError};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgListener, PgPool};
use sqlx::{AssertSqlSafe, Postgres};

use super::{MAX_TABLE_NAME, PostgresStore, backend};
use crate::outbox::{DEFAULT_OUTBOX_TABLE, Enqueue, cut, pending_of, prepare};

/// "Now" by the database clock in microseconds, plus the test skew bound at `$p`.
fn now(p: u8) -> String {
    format!("((extract(epoch FROM clock_timestamp()) * 1000000)::bigint + ${p}::bigint)")
}

struct Sql {
    ddl: Vec<String>,
    channel: String,
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
    fn new(schema: &str, table: &str) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        // A channel name is an identifier (at most 63 bytes): a digest of the qualified name.
        let digest = Sha256::digest(format!("{schema}.{table}").as_bytes());
        let channel = format!("idem_outbox_{}", &format!("{digest:x}")[..24]);
        let s = |x: String| -> Arc<str> { x.into() };
        Self {
            ddl: vec![
                format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""),
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                       seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                       message_id TEXT NOT NULL, \
                       destination TEXT NOT NULL, \
                       ordering_key TEXT, \
                       payload BYTEA NOT NULL, \
                       headers TEXT NOT NULL, \
                       created_at BIGINT NOT NULL, \
                       state SMALLINT NOT NULL DEFAULT 0, \
                       failures INTEGER NOT NULL DEFAULT 0, \
                       due_at BIGINT NOT NULL, \
                       lease_until BIGINT NOT NULL DEFAULT 0, \
                       token BIGINT NOT NULL DEFAULT 0, \
                       sent_at BIGINT, \
                       last_error TEXT) \
                     WITH (fillfactor = 70)"
                ),
                format!(
                    "CREATE UNIQUE INDEX IF NOT EXISTS \"{table}_message_id\" ON {t} (message_id)"
                ),
                // What claims scan: unsent rows in order.
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_unsent\" ON {t} (seq) WHERE state <> 1"
                ),
                // The ordering check: earlier unsent rows of one destination and key.
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_ordering\" ON {t} \
                     (destination, ordering_key, seq) WHERE state <> 1 AND ordering_key IS NOT NULL"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}_sent\" ON {t} (sent_at) WHERE state = 1"
                ),
                // Relays LISTEN on the channel; one notification per committing statement.
                format!(
                    "CREATE OR REPLACE FUNCTION \"{schema}\".\"{table}_notify\"() RETURNS trigger \
                     LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$"
                ),
                format!(
                    "CREATE OR REPLACE TRIGGER \"{table}_notify\" AFTER INSERT ON {t} \
                     FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".\"{table}_notify\"()"
                ),
            ],
            // $1 id, $2 destination, $3 ordering key, $4 payload, $5 headers, $6 skew.
            enqueue: s(format!(
                "INSERT INTO {t} (message_id, destination, ordering_key, payload, headers, created_at, due_at) \
                 SELECT $1, $2, $3, $4, $5, n.now, n.now FROM (SELECT {now} AS now) n \
                 ON CONFLICT (message_id) DO NOTHING",
                now = now(6)
            )),
            // $1 limit, $2 lease µs, $3 skew. Only the oldest unsent row of an ordering key is
            // a candidate; an earlier one is unsent in every snapshot until it is marked sent,
            // so two relays never lease two rows of one key, whatever SKIP LOCKED skips.
            claim: s(format!(
                "WITH n AS (SELECT {now} AS now), \
                 c AS (SELECT o.seq FROM {t} o, n \
                       WHERE o.state = 0 AND o.due_at <= n.now AND o.lease_until <= n.now \
                         AND (o.ordering_key IS NULL OR NOT EXISTS (\
                              SELECT 1 FROM {t} p WHERE p.destination = o.destination \
                              AND p.ordering_key = o.ordering_key AND p.seq < o.seq AND p.state <> 1)) \
                       ORDER BY o.seq LIMIT $1 FOR UPDATE OF o SKIP LOCKED) \
                 UPDATE {t} o SET lease_until = n.now + $2, token = o.token + 1 \
                 FROM c, n WHERE o.seq = c.seq \
                 RETURNING o.seq, o.token, o.failures::bigint, o.message_id, o.destination, o.payload, \
                           o.headers, o.ordering_key",
                now = now(3)
            )),
            // $1 seqs, $2 tokens, $3 skew.
            sent: s(format!(
                "UPDATE {t} o SET state = 1, sent_at = {now}, lease_until = 0 \
                 FROM unnest($1::bigint[], $2::bigint[]) AS x(seq, token) \
                 WHERE o.seq = x.seq AND o.token = x.token AND o.state = 0",
                now = now(3)
            )),
            // $1 seqs, $2 tokens.
            remove: s(format!(
                "DELETE FROM {t} o USING unnest($1::bigint[], $2::bigint[]) AS x(seq, token) \
                 WHERE o.seq = x.seq AND o.token = x.token AND o.state = 0"
            )),
            // $1 seqs, $2 tokens, $3 reasons, $4 retry µs (NULL parks), $5 skew.
            failed: s(format!(
                "UPDATE {t} o SET failures = o.failures + 1, last_error = x.reason, lease_until = 0, \
                   token = o.token + 1, \
                   state = CASE WHEN x.retry IS NULL THEN 2 ELSE 0 END, \
                   due_at = {now} + COALESCE(x.retry, 0) \
                 FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[]) AS x(seq, token, reason, retry) \
                 WHERE o.seq = x.seq AND o.token = x.token AND o.state = 0",
                now = now(5)
            )),
            // $1 older than µs, $2 limit, $3 skew.
            purge: s(format!(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 1 \
                 AND sent_at <= {now} - $1 ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
                now = now(3)
            )),
            // $1 limit, $2 skew.
            retry_parked: s(format!(
                "UPDATE {t} SET state = 0, failures = 0, due_at = {now} \
                 WHERE seq IN (SELECT seq FROM {t} WHERE state = 2 ORDER BY seq LIMIT $1)",
                now = now(2)
            )),
            counts: s(format!("SELECT state, count(*) FROM {t} GROUP BY state")),
            // Parked (2) first, then pending (0), each in enqueue order.
            unsent: s(format!(
                "SELECT seq, message_id, destination, state, failures, last_error FROM {t} \
                 WHERE state IN (0, 2) ORDER BY state DESC, seq LIMIT $1"
            )),
            channel,
        }
    }
}

/// The transactional outbox on PostgreSQL: messages enqueued in the caller's transaction,
/// leased to relays with `FOR UPDATE SKIP LOCKED`, relays woken by `LISTEN/NOTIFY` (a trigger
/// notifies when an enqueue commits; the relay still polls as a fallback).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::outbox::Outgoing;
/// use idem_sqlx::PostgresStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// let outbox = store.outbox();
/// outbox.migrate().await?;
/// let mut tx = store.pool().begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ('o-1')").execute(&mut *tx).await?;
/// outbox.enqueue(&mut tx, Outgoing::new("orders.accepted", r#"{"order":"o-1"}"#)).await?;
/// tx.commit().await?; // the order and the message commit together
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresOutbox {
    pool: PgPool,
    schema: Identifier,
    table: Identifier,
    sql: Arc<Sql>,
    skew: ClockSkew,
    wake: Arc<Wake>,
}

/// Commits seen on the `LISTEN` channel, shared by every relay loop on this outbox.
///
/// One background task (started by the first wait) listens and sets `dirty` and wakes the
/// waiters on each notification; a claim clears `dirty` as it starts, so a commit that lands
/// between a claim and the next wait is never slept through.
#[derive(Default)]
struct Wake {
    dirty: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
    started: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for PostgresOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOutbox")
            .field("schema", &self.schema)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// The outbox beside this store: same pool, schema and clock, table `idem_outbox`.
    pub fn outbox(&self) -> PostgresOutbox {
        let table =
            Identifier::new("outbox table name", DEFAULT_OUTBOX_TABLE).expect("default is valid");
        PostgresOutbox {
            pool: self.pool().clone(),
            sql: Arc::new(Sql::new(self.schema(), table.as_str())),
            schema: self.schema.clone(),
            table,
            skew: self.skew.clone(),
            wake: Arc::default(),
        }
    }
}

impl PostgresOutbox {
    /// Uses another table (letters, digits, `_`; at most 52 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        let table = Identifier::with_limit("outbox table name", name, MAX_TABLE_NAME)?;
        self.table = table;
        self.sql = Arc::new(Sql::new(self.schema.as_str(), self.table.as_str()));
        self.wake = Arc::default();
        Ok(self)
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The `LISTEN/NOTIFY` channel enqueues notify.
    pub fn channel(&self) -> &str {
        &self.sql.channel
    }

    /// Creates the table, its indexes and the notify trigger if missing. Idempotent and safe
    /// when several processes start at once.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: the DDL runs in one transaction, rolled back if it is dropped.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(|e| backend("outbox migrate", e))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("idem-migrate:{}.{}", self.schema, self.table))
            .execute(&mut *tx)
            .await
            .map_err(|e| backend("outbox migrate", e))?;
        for stmt in &self.sql.ddl {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&mut *tx)
                .await
                .map_err(|e| backend("outbox migrate", e))?;
        }
        tx.commit().await.map_err(|e| backend("outbox migrate", e))
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
        to: &mut impl Enqueue<Postgres>,
        msg: Outgoing,
    ) -> Result<OutboxId, OutboxError> {
        let m = prepare(to, msg)?;
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.enqueue)))
            .bind(m.id().as_str())
            .bind(m.destination())
            .bind(m.ordering_key())
            .bind(m.payload())
            .bind(m.headers_json())
            .bind(self.skew.micros())
            .execute(to.connection())
            .await
            .map_err(|e| backend("outbox enqueue", e))?;
        Ok(m.id().clone())
    }

    /// Starts the listening task once; it ends when the last clone of this outbox is gone.
    fn start_listening(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if self.wake.started.compare_exchange(false, true, SeqCst, SeqCst).is_ok() {
            let (pool, channel, wake) =
                (self.pool.clone(), self.sql.channel.clone(), Arc::downgrade(&self.wake));
            tokio::spawn(listen(pool, channel, wake));
        }
    }
}

impl OutboxStore for PostgresOutbox {
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
        // Commits notified from here on may hold rows this claim does not see.
        self.wake.dirty.store(false, std::sync::atomic::Ordering::SeqCst);
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim)))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(duration_micros(lease))
            .bind(self.skew.micros())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("outbox claim", e))?;
        pending_of(rows)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        if tickets.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = tickets.iter().map(|t| t.row).collect();
        let tokens: Vec<i64> = tickets.iter().map(|t| t.token).collect();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.sent)))
            .bind(&seqs)
            .bind(&tokens)
            .bind(self.skew.micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox mark_sent", e))?;
        Ok(done.rows_affected())
    }

    async fn remove_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        if tickets.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = tickets.iter().map(|t| t.row).collect();
        let tokens: Vec<i64> = tickets.iter().map(|t| t.token).collect();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.remove)))
            .bind(&seqs)
            .bind(&tokens)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox remove_sent", e))?;
        Ok(done.rows_affected())
    }

    async fn mark_failed(&self, failures: &[PublishFailure]) -> Result<u64, StoreError> {
        if failures.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = failures.iter().map(|f| f.ticket.row).collect();
        let tokens: Vec<i64> = failures.iter().map(|f| f.ticket.token).collect();
        let reasons: Vec<&str> = failures.iter().map(|f| cut(&f.reason)).collect();
        let retry: Vec<Option<i64>> =
            failures.iter().map(|f| f.retry_in.map(duration_micros)).collect();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.failed)))
            .bind(&seqs)
            .bind(&tokens)
            .bind(&reasons)
            .bind(&retry)
            .bind(self.skew.micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox mark_failed", e))?;
        Ok(done.rows_affected())
    }

    async fn purge_sent(&self, older_than: Duration, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(duration_micros(older_than))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(self.skew.micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox purge", e))?;
        Ok(done.rows_affected())
    }

    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.retry_parked)))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(self.skew.micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("outbox retry_parked", e))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        let rows: Vec<(i16, i64)> = sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.counts)))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("outbox counts", e))?;
        crate::outbox::counts_of(rows.into_iter().map(|(s, n)| (i64::from(s), n)))
    }

    async fn unsent(&self, limit: usize) -> Result<Vec<UnsentRow>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(i64, String, String, i16, i32, Option<String>)> =
            sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.unsent)))
                .bind(limit)
                .fetch_all(&self.pool)
                .await
                .map_err(|e| backend("outbox unsent", e))?;
        Ok(crate::outbox::unsent_of(rows.into_iter().map(
            |(seq, id, to, state, failures, error)| {
                (seq, id, to, i64::from(state), i64::from(failures), error)
            },
        )))
    }

    async fn wait_for_work(&self, max: Duration) {
        self.start_listening();
        let wake = &self.wake;
        let notified = wake.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if wake.dirty.load(std::sync::atomic::Ordering::SeqCst) {
            return; // a commit since the last claim
        }
        let _ = tokio::time::timeout(max, notified).await;
    }
}

/// The listening task: wakes relay loops on each notification; reconnects after a failure
/// (notifications in between are lost, and the relays' polling covers them).
async fn listen(pool: PgPool, channel: String, wake: std::sync::Weak<Wake>) {
    let mut backoff = Duration::from_millis(100);
    'connect: loop {
        if wake.strong_count() == 0 {
            return;
        }
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(mut l) => match l.listen(&channel).await {
                Ok(()) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox LISTEN failed; relays poll meanwhile");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue 'connect;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "outbox LISTEN connection failed; relays poll meanwhile");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue 'connect;
            }
        };
        backoff = Duration::from_millis(100);
        loop {
            // Wakes every second to notice that the outbox was dropped.
            let next = tokio::time::timeout(Duration::from_secs(1), listener.try_recv()).await;
            let Some(w) = wake.upgrade() else { return };
            match next {
                Ok(Ok(Some(_))) => {
                    w.dirty.store(true, std::sync::atomic::Ordering::SeqCst);
                    w.notify.notify_waiters();
                }
                Err(_) => {}
                // Connection lost or failed: wake everyone (something may have been missed).
                Ok(Ok(None)) | Ok(Err(_)) => {
                    w.dirty.store(true, std::sync::atomic::Ordering::SeqCst);
                    w.notify.notify_waiters();
                    continue 'connect;
                }
            }
        }
    }
}
