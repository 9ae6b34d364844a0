//! SQLite: the embedded default store (no server) and its transactional inbox.

mod inbox;
mod outbox;
mod positions;
mod sql;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idem_core::claim::next_token;
use idem_core::time::{Clock, SystemClock};
use idem_core::{
    Advance, Claim, ClaimRequest, Completion, Counts, DedupKey, DedupStore, FailKind, Identifier,
    IdentifierError, InspectStore, Lease, ListFilter, Record, RecordState, StoreError, Timestamp,
    VersionGuard,
};
use sqlx::AssertSqlSafe;
use sqlx::sqlite::{
    Sqlite, SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};

pub use inbox::SqliteInbox;
pub use outbox::SqliteOutbox;

use crate::row::{Won, decode_row, fenced, i64_of, lease_from_parts, lost, nullable, required};
use crate::{DEFAULT_TABLE, MAX_RESULT_BYTES};
use sql::Sql;

/// The embedded store: one SQLite file, no server.
///
/// Claims are single `INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING` statements, so SQLite's
/// write lock arbitrates every race. The store's clock is a [`Clock`] in this process (the
/// system clock by default): every process sharing the file runs on the same host and reads the
/// same clock.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_sqlx::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
/// let req = ClaimRequest::new(DedupKey::new("orders", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// let Claim::Acquired(lease) = store.claim(&req).await? else { unreachable!() };
/// store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// assert!(matches!(store.claim(&req).await?, Claim::Completed(_)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    table: Identifier,
    sql: Arc<Sql>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("table", &self.table).finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) a database file with durable defaults — WAL journal,
    /// `synchronous = FULL`, a 5 s busy timeout — and creates the default table if missing:
    /// the file is the embedded store's own. For another table name, wrap the pool with
    /// [`new`](Self::new) and [`with_table_name`](Self::with_table_name), then
    /// [`migrate`](Self::migrate).
    ///
    /// The pool has one connection: SQLite has one writer at a time, and queueing in the pool
    /// is fairer and faster than many connections sleeping in SQLite's busy handler. So do not
    /// call store methods while holding a transaction from [`SqliteStore::pool`]: they wait for
    /// the connection that transaction holds. Inside a transaction, use the inbox's `mark`.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the file cannot be opened or the schema created.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: dropped midway, the file may exist with part of the schema;
    /// opening it again completes it (every statement is `IF NOT EXISTS`).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5));
        Self::open_with(opts).await
    }

    /// Opens with your own connection options (for example `synchronous = NORMAL`, which in WAL
    /// mode survives a process crash but may lose the last commits on power loss).
    ///
    /// # Errors
    /// As [`SqliteStore::open`].
    ///
    /// # Cancel safety
    /// As [`SqliteStore::open`].
    pub async fn open_with(opts: SqliteConnectOptions) -> Result<Self, StoreError> {
        let pool = when_unlocked(|| {
            SqlitePoolOptions::new().max_connections(1).connect_with(opts.clone())
        })
        .await
        .map_err(|e| backend("open", e))?;
        let store = Self::new(pool);
        store.migrate().await?;
        Ok(store)
    }

    /// Wraps an existing pool, with the default table name. Call [`SqliteStore::migrate`]
    /// unless your own migrations create the table.
    pub fn new(pool: SqlitePool) -> Self {
        let table = Identifier::new("table name", DEFAULT_TABLE).expect("default name is valid");
        Self { sql: Arc::new(Sql::new(&table)), pool, table, clock: Arc::new(SystemClock) }
    }

    /// Uses another table (letters, digits, `_`; at most 63 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        self.table = Identifier::new("table name", name)?;
        self.sql = Arc::new(Sql::new(&self.table));
        Ok(self)
    }

    /// Reads time from `clock` (tests use a `ManualClock`).
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Creates the tables and indexes if they do not exist (idempotent).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: each statement commits on its own and is `IF NOT EXISTS`, so
    /// running it again after a dropped call finishes the job.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        execute_ddl(&self.pool, &self.sql.ddl).await.map_err(|e| backend("migrate", e))?;
        let has_deaths: bool = sqlx::query_scalar(
            "SELECT count(*) > 0 FROM pragma_table_info(?1) WHERE name = 'deaths'",
        )
        .bind(self.table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| backend("migrate", e))?;
        if !has_deaths {
            match execute_ddl(&self.pool, std::slice::from_ref(&self.sql.add_deaths)).await {
                // Another process migrating at the same time added it first.
                Err(e) if e.to_string().contains("duplicate column name") => {}
                done => done.map_err(|e| backend("migrate", e))?,
            }
        }
        Ok(())
    }

    /// Startup check, run by a consumer's `build` ([`DedupStore::check`]): fails when the
    /// table does not exist or lacks a column ([`StoreError::NotMigrated`], naming the table
    /// and `SqliteStore::migrate()`). Returns no warnings: the durability settings are the
    /// connection's own.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`]; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        let names: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info(?1)")
            .bind(self.table.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("check", e))?;
        let table = format!("\"{}\"", self.table);
        match crate::check::unmigrated(table, &names, &[], "SqliteStore::migrate()") {
            Some(e) => Err(e),
            None => Ok(Vec::new()),
        }
    }

    /// The DDL [`SqliteStore::migrate`] runs on a new database, for users who own their
    /// migrations, in two steps (as shipped in `migrations/sqlite/`): the tables, then
    /// `ALTER TABLE … ADD COLUMN deaths …`, which a database that has the first step applies
    /// once.
    pub fn schema(&self) -> String {
        self.sql.ddl.iter().chain([&self.sql.add_deaths]).map(|s| format!("{s};\n")).collect()
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// A transactional inbox over the same table, keeping markers for `retain_for`.
    pub fn inbox(&self, retain_for: Duration) -> SqliteInbox {
        SqliteInbox::new(self.clone(), retain_for)
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// The claim upsert on one connection; `None` when the claim lost.
    async fn try_acquire(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest,
        now: Timestamp,
    ) -> Result<Option<Lease>, StoreError> {
        let token = i64_of(next_token(None, now), "token")?;
        let mut q = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim)));
        for n in 1..=9 {
            q = bind_claim_param(q, n, req, now, token);
        }
        let row = q.fetch_optional(&mut *conn).await.map_err(|e| backend("claim", e))?;
        row.map(|row| won_lease(&row, req, now)).transpose()
    }

    /// Claims distinct keys on one connection, as [`claim_on`](Self::claim_on) would one by one:
    /// their upserts in one call per 100 keys (one hop to the connection's thread), then one read
    /// of the records of those that lost. No other request of the batch touches a key that lost
    /// (the keys are distinct) and the transaction holds the write lock, so the record read is
    /// the one its upsert found. A record claimable again by then is claimed alone.
    async fn claim_distinct_on(
        &self,
        conn: &mut SqliteConnection,
        reqs: &[ClaimRequest],
    ) -> Result<Vec<Claim>, StoreError> {
        let now = self.now();
        let token = i64_of(next_token(None, now), "token")?;
        let mut out: Vec<Option<Claim>> = reqs.iter().map(|_| None).collect();
        let index: std::collections::HashMap<[u8; 32], usize> =
            reqs.iter().enumerate().map(|(i, r)| (r.key.hash().0, i)).collect();
        let params = self.sql.claim_params();
        for chunk in reqs.chunks(100) {
            let mut q = sqlx::query(AssertSqlSafe(self.sql.claim_many(chunk.len())));
            for req in chunk {
                for &n in &params {
                    q = bind_claim_param(q, n, req, now, token);
                }
            }
            for row in q.fetch_all(&mut *conn).await.map_err(|e| backend("claim_many", e))? {
                let hash: Vec<u8> = required(&row, 5, "key_hash")?;
                let Some(&i) =
                    <[u8; 32]>::try_from(hash.as_slice()).ok().and_then(|h| index.get(&h))
                else {
                    return Err(StoreError::Corrupt {
                        what: "a claim answered for a key not asked".into(),
                    });
                };
                out[i] = Some(Claim::Acquired(won_lease(&row, &reqs[i], now)?));
            }
        }
        let losers: Vec<usize> = (0..reqs.len()).filter(|&i| out[i].is_none()).collect();
        let hashes: Vec<[u8; 32]> = losers.iter().map(|&i| reqs[i].key.hash().0).collect();
        let mut recs = self.records(conn, &hashes, "claim_many").await?;
        for i in losers {
            let req = &reqs[i];
            let found = recs.remove(&req.key.hash().0);
            out[i] = Some(match found.and_then(|r| lost(r, req.fingerprint, now, req.takeover)) {
                Some(c) => c,
                None => self.claim_on(conn, req).await?,
            });
        }
        out.into_iter()
            .map(|c| {
                c.ok_or_else(|| StoreError::Corrupt { what: "a claim without an answer".into() })
            })
            .collect()
    }

    /// The records of `hashes` (one read per 500), by key hash; a key without one is absent.
    pub(super) async fn records(
        &self,
        conn: &mut SqliteConnection,
        hashes: &[[u8; 32]],
        op: &'static str,
    ) -> Result<std::collections::HashMap<[u8; 32], Record>, StoreError> {
        let mut recs = std::collections::HashMap::with_capacity(hashes.len());
        for chunk in hashes.chunks(500) {
            let mut sel = sqlx::query(AssertSqlSafe(self.sql.select_many(chunk.len())));
            for h in chunk {
                sel = sel.bind(h.to_vec());
            }
            for row in &sel.fetch_all(&mut *conn).await.map_err(|e| backend(op, e))? {
                let rec = decode_row(row)?;
                recs.insert(rec.key_hash.0, rec);
            }
        }
        Ok(recs)
    }

    /// Claims on one connection: the upsert, then — only if it lost — a read that explains why.
    async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        // The read after a lost upsert may race a change (the holder completed, released, or a
        // purge ran); when the row it finds is claimable again, or gone, try the write again.
        for _ in 0..8 {
            let now = self.now();
            if let Some(lease) = self.try_acquire(conn, req, now).await? {
                return Ok(Claim::Acquired(lease));
            }
            let Some(rec) = self.fetch(conn, &req.key).await? else { continue };
            if let Some(claim) = lost(rec, req.fingerprint, now, req.takeover) {
                return Ok(claim);
            }
        }
        Err(StoreError::backend(
            "claim",
            true,
            "record kept changing under the claim (8 tries); try again",
        ))
    }

    async fn fetch(
        &self,
        conn: &mut SqliteConnection,
        key: &DedupKey,
    ) -> Result<Option<Record>, StoreError> {
        sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.select)))
            .bind(&key.hash().0[..])
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("get", e))?
            .map(|r| decode_row(&r))
            .transpose()
    }

    async fn finish(
        &self,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("complete", e))?;
        self.finish_on(&mut conn, lease, state, result, retain_for).await?
    }

    /// Ends a lease on `conn`. The outer error is the database's; the inner one the lease's
    /// own answer (too large, lost), which leaves a surrounding transaction usable.
    async fn finish_on(
        &self,
        conn: &mut SqliteConnection,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<Result<(), StoreError>, StoreError> {
        if let Err(e) =
            StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)
        {
            return Ok(Err(e));
        }
        let now = self.now();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.finish)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(i64::from(state.code()))
            .bind(result)
            .bind(now.as_micros())
            .bind(now.plus(retain_for).as_micros())
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("complete", e))?;
        Ok(fenced(done.rows_affected(), lease))
    }

    /// Raises `entity`'s version inside the caller's transaction (apply the state and the version
    /// in one commit). See [`VersionGuard`].
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the caller's transaction commits.
    pub async fn advance_in(
        &self,
        conn: &mut SqliteConnection,
        entity: &DedupKey,
        version: i64,
    ) -> Result<Advance, StoreError> {
        let hash = entity.hash();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.advance)))
            .bind(&hash.0[..])
            .bind(entity.scope())
            .bind(entity.id())
            .bind(version)
            .bind(self.now().as_micros())
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("advance", e))?;
        if done.rows_affected() == 1 {
            return Ok(Advance::Applied);
        }
        let current: i64 = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.version_of)))
            .bind(&hash.0[..])
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| backend("advance", e))?;
        Ok(Advance::Stale { current })
    }
}

/// Classifies a driver error: busy/locked databases, pool timeouts and I/O are retryable.
pub(crate) fn backend(op: &'static str, e: sqlx::Error) -> StoreError {
    let retryable = match &e {
        sqlx::Error::Database(db) => {
            // SQLITE_BUSY (5), SQLITE_LOCKED (6) and their extended codes (x + 256·n).
            db.code().and_then(|c| c.parse::<i64>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6))
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        _ => false,
    };
    StoreError::backend(op, retryable, e)
}

/// Binds the claim upsert's parameter `?n` (1 ..= 9) for `req`, claimed at `now` with `token`.
fn bind_claim_param<'q>(
    q: sqlx::query::Query<'q, Sqlite, SqliteArguments>,
    n: u8,
    req: &'q ClaimRequest,
    now: Timestamp,
    token: i64,
) -> sqlx::query::Query<'q, Sqlite, SqliteArguments> {
    match n {
        1 => q.bind(req.key.hash().0.to_vec()),
        2 => q.bind(req.key.scope()),
        3 => q.bind(req.key.id()),
        4 => q.bind(req.fingerprint.as_ref().map(|f| &f.0[..])),
        5 => q.bind(now.as_micros()),
        6 => q.bind(now.plus(req.lease_for).as_micros()),
        7 => q.bind(now.plus(req.retain_for.max(req.lease_for)).as_micros()),
        8 => q.bind(token),
        _ => q.bind(req.takeover),
    }
}

/// The lease a winning claim upsert returned (`attempt, token, prev_state, fingerprint,
/// deaths, …`) for `req`, claimed at `now`.
fn won_lease(row: &SqliteRow, req: &ClaimRequest, now: Timestamp) -> Result<Lease, StoreError> {
    let won = Won {
        attempt: required(row, 0, "attempt")?,
        token: required(row, 1, "token")?,
        prev: nullable(row, 2, "prev_state")?,
        fp: nullable(row, 3, "fingerprint")?,
        deaths: required(row, 4, "deaths")?,
        until: now.plus(req.lease_for).as_micros(),
    };
    lease_from_parts(&req.key, won)
}

impl DedupStore for SqliteStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("claim", e))?;
        self.claim_on(&mut conn, req).await
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        // One transaction, one commit (one fsync) for the whole batch.
        let mut tx =
            self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| backend("claim_many", e))?;
        let mut keys = std::collections::HashSet::with_capacity(reqs.len());
        let distinct = reqs.iter().all(|r| keys.insert(r.key.hash()));
        let out = if reqs.len() > 1 && distinct {
            self.claim_distinct_on(&mut tx, reqs).await?
        } else {
            // A key repeated in the batch is decided after its earlier requests: one by one.
            let mut out = Vec::with_capacity(reqs.len());
            for req in reqs {
                out.push(self.claim_on(&mut tx, req).await?);
            }
            out
        };
        tx.commit().await.map_err(|e| backend("claim_many", e))?;
        Ok(out)
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(&lease, RecordState::Completed, result, retain_for).await
    }

    /// One call of one `UPDATE` per completion (up to 500; one hop to the connection's thread),
    /// one transaction (one commit, one fsync) for the batch.
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let now = self.now();
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        // Each (key, token) once: a lease listed twice completes with its first result, and
        // its later copies find it completed (lost), as one-by-one completions would.
        let mut sent: Vec<(usize, i64)> = Vec::with_capacity(items.len());
        let mut seen = std::collections::HashSet::with_capacity(items.len());
        for (i, c) in items.iter().enumerate() {
            let size = c.result.as_ref().map_or(0, Vec::len);
            if let Err(e) = StoreError::check_len("result", size, MAX_RESULT_BYTES) {
                out.push(Some(Err(e)));
            } else if !seen.insert((c.lease.key().hash(), c.lease.token())) {
                out.push(Some(Err(StoreError::LeaseLost { key: c.lease.key().to_string() })));
            } else {
                out.push(None);
                sent.push((i, i64_of(c.lease.token(), "token")?));
            }
        }
        if sent.is_empty() {
            return Ok(out.into_iter().flatten().collect());
        }
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| backend("complete_many", e))?;
        let mut done = std::collections::HashSet::with_capacity(sent.len());
        for chunk in sent.chunks(500) {
            let mut q = sqlx::query_as::<_, (Vec<u8>, i64)>(AssertSqlSafe(
                self.sql.complete_many(chunk.len()),
            ));
            for &(i, token) in chunk {
                let c = &items[i];
                q = q
                    .bind(now.as_micros())
                    .bind(now.plus(c.retain_for).as_micros())
                    .bind(c.result.as_deref())
                    .bind(c.lease.key().hash().0.to_vec())
                    .bind(token);
            }
            done.extend(q.fetch_all(&mut *tx).await.map_err(|e| backend("complete_many", e))?);
        }
        tx.commit().await.map_err(|e| backend("complete_many", e))?;
        for (i, token) in sent {
            let lease = &items[i].lease;
            let completed = done.contains(&(lease.key().hash().0.to_vec(), token));
            out[i] = Some(fenced(u64::from(completed), lease));
        }
        Ok(out.into_iter().flatten().collect())
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(&lease, kind.state(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(self.now().as_micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("release", e))?;
        fenced(done.rows_affected(), &lease)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let now = self.now();
        let until = now.plus(by);
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.extend)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(until.as_micros())
            .bind(now.as_micros())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("extend", e))?;
        fenced(done.rows_affected(), lease)?;
        lease.set_until(until);
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(self.now().as_micros())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| backend("purge", e))?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        SqliteStore::check(self).await
    }
}

impl InspectStore for SqliteStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("get", e))?;
        self.fetch(&mut conn, key).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.list)))
            .bind(filter.scope.as_deref())
            .bind(filter.state.map(|s| i64::from(s.code())))
            .bind(i64::try_from(filter.limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("list", e))?;
        rows.iter().map(decode_row).collect()
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.count)))
            .bind(scope)
            .bind(self.now().as_micros())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("count", e))?;
        crate::row::counts_of(&rows)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let now = self.now();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_release)))
            .bind(&key.hash().0[..])
            .bind(i64_of(next_token(None, now), "token")?)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let now = self.now();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_fail)))
            .bind(&key.hash().0[..])
            .bind(i64_of(next_token(None, now), "token")?)
            .bind(reason.as_bytes())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(done.rows_affected() == 1)
    }
}

impl VersionGuard for SqliteStore {
    async fn advance(&self, entity: &DedupKey, version: i64) -> Result<Advance, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("advance", e))?;
        self.advance_in(&mut conn, entity, version).await
    }
}

/// How long opening a database or creating its tables keeps trying while SQLite answers
/// "database is locked" without waiting.
const LOCKED_PATIENCE: Duration = Duration::from_secs(10);

/// Runs `attempt` again while it fails with `SQLITE_BUSY`, for up to [`LOCKED_PATIENCE`].
///
/// The busy timeout makes SQLite wait for a lock, except where waiting could deadlock: when
/// several processes open one new file at once, one turning it into a WAL database or creating
/// a table while another holds a read lock it wants to upgrade, SQLite answers `SQLITE_BUSY` at
/// once (its busy handler is not called). Such an attempt succeeds once the other is done.
async fn when_unlocked<T, F, Fut>(mut attempt: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        match attempt().await {
            Err(e) if locked(&e) && started.elapsed() < LOCKED_PATIENCE => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// `SQLITE_BUSY` or one of its extended codes ("database is locked").
fn locked(e: &sqlx::Error) -> bool {
    const SQLITE_BUSY: i32 = 5;
    match e {
        sqlx::Error::Database(d) => {
            d.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| c & 0xff == SQLITE_BUSY)
        }
        _ => false,
    }
}

/// Runs the `CREATE … IF NOT EXISTS` statements of a migration, each again while SQLite
/// answers "database is locked" (see [`when_unlocked`]).
pub(crate) async fn execute_ddl(pool: &SqlitePool, ddl: &[String]) -> Result<(), sqlx::Error> {
    for stmt in ddl {
        when_unlocked(|| sqlx::query(AssertSqlSafe(stmt.as_str())).execute(pool)).await?;
    }
    Ok(())
}
