//! PostgreSQL: the production store, its transactional inbox and the entity-as-marker helper.

mod entity;
mod inbox;
mod outbox;
mod sql;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::time::{ClockSkew, duration_micros};
use idem_core::{
    Advance, Claim, ClaimRequest, Completion, Counts, DedupKey, DedupStore, FailKind, Fingerprint,
    Identifier, IdentifierError, InspectStore, Lease, ListFilter, Record, RecordState, StoreError,
    Timestamp, VersionGuard,
};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};

pub use entity::EntityTable;
pub use inbox::PostgresInbox;
pub use outbox::PostgresOutbox;

use crate::row::{
    Loser, classify_loser, decode_row, decode_row_at, fenced, i64_of, lease_from_parts, nullable,
    required,
};
use crate::{DEFAULT_TABLE, MAX_RESULT_BYTES};
use sql::Sql;

/// Default schema of the PostgreSQL store.
pub const DEFAULT_SCHEMA: &str = "idem";

/// Longest table name: derived names (`<table>_versions`, `<table>_expires_at`) must stay
/// within PostgreSQL's 63-byte identifier limit, which it would otherwise cut silently.
pub const MAX_TABLE_NAME: usize = 52;

/// The PostgreSQL store.
///
/// A claim is one statement — `INSERT … ON CONFLICT (key_hash) DO UPDATE … WHERE <claimable>
/// RETURNING` — so the row lock of the primary key arbitrates every race; `claim_many` is one
/// statement over `unnest` arrays (and, when some keys were taken, one read of their records).
/// Leases and expiries are measured by the database clock
/// (`statement_timestamp()`), never by the consumers'. Records live in their own schema
/// (`idem` by default).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_sqlx::PostgresStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
/// let req = ClaimRequest::new(DedupKey::new("orders", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// if let Claim::Acquired(lease) = store.claim(&req).await? {
///     store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    schema: Identifier,
    table: Identifier,
    sql: Arc<Sql>,
    skew: ClockSkew,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.schema)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects a pool of 16 connections to `url`. Creates nothing: choose the schema and
    /// table ([`with_schema`](Self::with_schema), [`with_table_name`](Self::with_table_name)),
    /// then create them once with [`migrate`](Self::migrate) (or your own migrations, from
    /// [`schema_sql`](Self::schema_sql)). A consumer's `build` runs [`check`](Self::check),
    /// which fails naming `migrate()` when the table is missing.
    ///
    /// TLS (feature `rustls`) is set in the URL, as libpq does:
    /// `postgres://app@db.example:5432/app?sslmode=verify-full&sslrootcert=/etc/ca.pem`, with
    /// `sslcert=…&sslkey=…` for a client certificate. `verify-full` checks the chain and the host
    /// name; `require` only encrypts (libpq's meaning). Without the feature, `require` and
    /// stricter are refused, never downgraded.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the server cannot be reached, the TLS handshake fails, or
    /// the URL asks for TLS this build lacks ([`TlsUnavailable`](crate::TlsUnavailable) as the
    /// source).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(crate::tls::pg_options(url)?)
            .await
            .map_err(|e| backend("connect", e))?;
        Ok(Self::new(pool))
    }

    /// Wraps an existing pool, with the default schema and table. Call
    /// [`PostgresStore::migrate`] unless your own migrations create the table
    /// (`migrations/postgres/` holds the same DDL).
    pub fn new(pool: PgPool) -> Self {
        let schema = Identifier::new("schema name", DEFAULT_SCHEMA).expect("default is valid");
        let table = Identifier::new("table name", DEFAULT_TABLE).expect("default is valid");
        Self {
            sql: Arc::new(Sql::new(schema.as_str(), table.as_str())),
            pool,
            schema,
            table,
            skew: ClockSkew::new(),
        }
    }

    /// Uses another schema (letters, digits, `_`; at most 63 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_schema(mut self, name: &str) -> Result<Self, IdentifierError> {
        self.schema = Identifier::new("schema name", name)?;
        self.sql = Arc::new(Sql::new(self.schema.as_str(), self.table.as_str()));
        Ok(self)
    }

    /// Uses another table (letters, digits, `_`; at most [`MAX_TABLE_NAME`] bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        let table = Identifier::with_limit("table name", name, MAX_TABLE_NAME)?;
        self.table = table;
        self.sql = Arc::new(Sql::new(self.schema.as_str(), self.table.as_str()));
        Ok(self)
    }

    /// Shifts the database clock by `skew` (tests move time this way instead of sleeping).
    #[must_use]
    pub fn with_clock_skew(mut self, skew: ClockSkew) -> Self {
        self.skew = skew;
        self
    }

    /// Creates the schema, tables and index if they do not exist. Idempotent, and safe when
    /// several processes start at once (it holds an advisory lock while it runs).
    ///
    /// # Errors
    /// Backend errors.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(|e| backend("migrate", e))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("idem-migrate:{}.{}", self.schema, self.table))
            .execute(&mut *tx)
            .await
            .map_err(|e| backend("migrate", e))?;
        for stmt in &self.sql.ddl {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&mut *tx)
                .await
                .map_err(|e| backend("migrate", e))?;
        }
        tx.commit().await.map_err(|e| backend("migrate", e))
    }

    /// The DDL [`PostgresStore::migrate`] runs, for users who own their migrations.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().map(|s| format!("{s};\n")).collect()
    }

    /// Startup checks, run by a consumer's `build` ([`DedupStore::check`]). Fails when the
    /// table does not exist in the schema or lacks a column ([`StoreError::NotMigrated`],
    /// naming the table and `PostgresStore::migrate()`). Returns, and logs with
    /// `tracing::warn!`, each problem that lets the store work but weakens a guarantee:
    /// `synchronous_commit` off (a committed marker may vanish in a crash, and the message then
    /// runs twice), or a key column that is not `bytea` (hashes compared as text may collate).
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`]; backend errors.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2",
        )
        .bind(self.schema.as_str())
        .bind(self.table.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(|e| backend("check", e))?;
        let names: Vec<String> = columns.iter().map(|(n, _)| n.clone()).collect();
        let table = format!("\"{}\".\"{}\"", self.schema, self.table);
        if let Some(e) = crate::check::unmigrated(table, &names, &[], "PostgresStore::migrate()") {
            return Err(e);
        }
        let mut warnings = Vec::new();
        let sync: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| backend("check", e))?;
        if sync == "off" {
            warnings.push(
                "PostgreSQL synchronous_commit is off: a dedup marker acknowledged as committed \
                 may vanish in a server crash, and its message would then run twice; set \
                 synchronous_commit = on for the idem connections"
                    .to_owned(),
            );
        }
        let key_type = columns.iter().find(|(n, _)| n == "key_hash").map(|(_, t)| t.as_str());
        if let Some(other) = key_type.filter(|t| *t != "bytea") {
            warnings.push(format!(
                "{}.{}.key_hash is `{other}`, not `bytea`: keys are 32-byte hashes and must be \
                 compared as bytes; recreate the table from PostgresStore::schema_sql()",
                self.schema, self.table
            ));
        }
        for w in &warnings {
            tracing::warn!(target: "idem::postgres", "{w}");
        }
        Ok(warnings)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// A transactional inbox over the same table, keeping markers for `retain_for`.
    pub fn inbox(&self, retain_for: Duration) -> PostgresInbox {
        PostgresInbox::new(self.clone(), retain_for)
    }

    fn skew(&self) -> i64 {
        self.skew.micros()
    }

    async fn upsert(
        &self,
        conn: &mut PgConnection,
        stmt: &Arc<str>,
        req: &ClaimRequest,
        lease_for: Option<Duration>,
    ) -> Result<Option<PgRow>, StoreError> {
        sqlx::query(AssertSqlSafe(Arc::clone(stmt)))
            .bind(&req.key.hash().0[..])
            .bind(req.key.scope())
            .bind(req.key.id())
            .bind(req.fingerprint.as_ref().map(|f| &f.0[..]))
            .bind(self.skew())
            .bind(lease_for.map(duration_micros))
            .bind(duration_micros(req.retain_for.max(lease_for.unwrap_or_default())))
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("claim", e))
    }

    /// Claims on one connection: the upsert, then — only if it lost — a read that explains why.
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        for _ in 0..8 {
            if let Some(row) = self.upsert(conn, &self.sql.claim, req, Some(req.lease_for)).await? {
                return lease_of(&req.key, &row).map(Claim::Acquired);
            }
            let Some((rec, now)) = self.fetch(conn, &req.key).await? else { continue };
            if let Some(claim) = lost(rec, req.fingerprint, now) {
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
        conn: &mut PgConnection,
        key: &DedupKey,
    ) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.select)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("get", e))?;
        let Some(row) = row else { return Ok(None) };
        let now: i64 = row.try_get(13).map_err(|e| backend("get", e))?;
        Ok(Some((decode_row(&row)?, Timestamp::from_micros(now))))
    }

    /// One upsert statement for a batch (`stmt`: the claim or the mark), then — only when some
    /// key was taken — one read of the losers. A key that repeats goes in once (its first
    /// occurrence), since one upsert cannot touch a row twice; rows go in key-hash order, so
    /// concurrent batches lock shared keys in one order (no deadlock). Answers: each distinct
    /// hash's first index, and each hash's row (won?, record, database now).
    #[allow(clippy::type_complexity)]
    async fn upsert_many(
        &self,
        conn: &mut PgConnection,
        reqs: &[ClaimRequest],
    ) -> Result<(HashMap<[u8; 32], usize>, HashMap<[u8; 32], (bool, Record, Timestamp)>), StoreError>
    {
        let mut first: HashMap<[u8; 32], usize> = HashMap::with_capacity(reqs.len());
        let (mut h, mut s, mut i, mut fp, mut lease, mut keep) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&n| (reqs[n].key.hash().0, n));
        for n in order {
            let r = &reqs[n];
            let hash = r.key.hash().0;
            if first.contains_key(&hash) {
                continue;
            }
            first.insert(hash, n);
            h.push(hash.to_vec());
            s.push(r.key.scope().to_owned());
            i.push(r.key.id().to_owned());
            fp.push(r.fingerprint.map(|f| f.0.to_vec()));
            lease.push(duration_micros(r.lease_for));
            keep.push(duration_micros(r.retain_for.max(r.lease_for)));
        }
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim_many)))
            .bind(&h)
            .bind(&s)
            .bind(&i)
            .bind(&fp)
            .bind(self.skew())
            .bind(&lease)
            .bind(&keep)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("claim_many", e))?;
        let mut found: HashMap<[u8; 32], (bool, Record, Timestamp)> = HashMap::new();
        decode_claimed(&rows, &mut found)?;
        let taken: Vec<&[u8; 32]> = first.keys().filter(|k| !found.contains_key(*k)).collect();
        self.read_losers(conn, &taken, &mut found).await?;
        Ok((first, found))
    }

    /// Reads the records of keys an upsert did not win (a second round trip, only when some).
    /// Run unprepared, so it is planned with its array every time: as a cached generic plan made
    /// while the table was tiny it scanned the whole table once grown.
    pub(crate) async fn read_losers(
        &self,
        conn: &mut PgConnection,
        losers: &[&[u8; 32]],
        found: &mut HashMap<[u8; 32], (bool, Record, Timestamp)>,
    ) -> Result<(), StoreError> {
        if losers.is_empty() {
            return Ok(());
        }
        let losers: Vec<&[u8]> = losers.iter().map(|k| &k[..]).collect();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim_many_losers)))
            .bind(&losers)
            .bind(self.skew())
            .persistent(false)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("claim_many", e))?;
        decode_claimed(&rows, found)
    }

    async fn finish(
        &self,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.finish)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(i64::from(state.code()))
            .bind(result)
            .bind(self.skew())
            .bind(duration_micros(retain_for))
            .execute(&self.pool)
            .await
            .map_err(|e| backend("complete", e))?;
        fenced(done.rows_affected(), lease)
    }

    /// Raises `entity`'s version inside the caller's transaction (apply the state and the
    /// version in one commit). See [`VersionGuard`].
    ///
    /// # Errors
    /// Backend errors.
    pub async fn advance_in(
        &self,
        conn: &mut PgConnection,
        entity: &DedupKey,
        version: i64,
    ) -> Result<Advance, StoreError> {
        let hash = entity.hash();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.advance)))
            .bind(&hash.0[..])
            .bind(entity.scope())
            .bind(entity.id())
            .bind(version)
            .bind(self.skew())
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

/// The answer of a claim that did not write; `None` when the record is claimable again.
fn lost(rec: Record, fingerprint: Option<Fingerprint>, now: Timestamp) -> Option<Claim> {
    match classify_loser(rec, fingerprint, now)? {
        Loser::Done(rec) => Some(Claim::Completed(rec)),
        Loser::Conflict(rec) => Some(Claim::Conflict(rec)),
        Loser::Leased(rec) => Some(Claim::InProgress {
            retry_after: rec.lease_until.unwrap_or(now).since(now),
            attempt: rec.attempt,
        }),
    }
}

/// The lease in a winning upsert's `RETURNING attempt, token, prev_state, fingerprint, lease_until`.
fn lease_of(key: &DedupKey, row: &PgRow) -> Result<Lease, StoreError> {
    let attempt = required(row, 0, "attempt")?;
    let token = required(row, 1, "token")?;
    let prev = nullable(row, 2, "prev_state")?;
    let fp = nullable(row, 3, "fingerprint")?;
    // A claim always sets the lease end: a NULL is corrupt, not a lease that ended in 1970.
    let until = required(row, 4, "lease_until")?;
    lease_from_parts(key, attempt, token, prev, fp, until)
}

/// Classifies a driver error: serialization failures, deadlocks, lost connections and pool
/// timeouts are retryable.
pub(crate) fn backend(op: &'static str, e: sqlx::Error) -> StoreError {
    let retryable = match &e {
        // 40001 serialization_failure, 40P01 deadlock_detected, 55P03 lock_not_available,
        // 57P01 admin_shutdown, 08xxx connection exceptions.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            matches!(c.as_ref(), "40001" | "40P01" | "55P03" | "57P01") || c.starts_with("08")
        }),
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        _ => false,
    };
    StoreError::backend(op, retryable, e)
}

impl DedupStore for PostgresStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("claim", e))?;
        self.claim_on(&mut conn, req).await
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.pool.acquire().await.map_err(|e| backend("claim_many", e))?;
        let (first, found) = self.upsert_many(&mut conn, reqs).await?;
        drop(conn);
        let mut out = Vec::with_capacity(reqs.len());
        for (n, req) in reqs.iter().enumerate() {
            let hash = req.key.hash().0;
            let answer = match found.get(&hash) {
                Some((true, rec, _)) if first.get(&hash) == Some(&n) => {
                    Some(Claim::Acquired(lease_from_parts(
                        &req.key,
                        i64::from(rec.attempt),
                        i64_of(rec.token, "token")?,
                        rec.previous.map(|p| i64::from(p.code())),
                        rec.fingerprint.map(|f| f.0.to_vec()),
                        rec.lease_until.map_or(0, Timestamp::as_micros),
                    )?))
                }
                Some((_, rec, now)) => lost(rec.clone(), req.fingerprint, *now),
                None => None,
            };
            match answer {
                Some(claim) => out.push(claim),
                // Claimable again by the time its record was read, or purged: decide it alone.
                None => out.push(self.claim(req).await?),
            }
        }
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

    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let (mut h, mut tok, mut res, mut keep) = (vec![], vec![], vec![], vec![]);
        for c in &items {
            if let Err(e) = StoreError::check_len(
                "result",
                c.result.as_ref().map_or(0, Vec::len),
                MAX_RESULT_BYTES,
            ) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            h.push(c.lease.key().hash().0.to_vec());
            tok.push(i64_of(c.lease.token(), "token")?);
            res.push(c.result.clone());
            keep.push(duration_micros(c.retain_for));
        }
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.complete_many)))
            .bind(&h)
            .bind(&tok)
            .bind(&res)
            .bind(&keep)
            .bind(self.skew())
            // Planned with its arrays on every run: a cached generic plan chosen while the
            // table was tiny (sequential scan, hash join) would read the whole table per batch
            // once it has grown (test: batch_statements_stay_index_lookups_as_the_table_grows).
            .persistent(false)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("complete_many", e))?;
        let mut done = std::collections::HashSet::with_capacity(rows.len());
        for row in &rows {
            let get = |e| backend("complete_many", e);
            let hash: Vec<u8> = row.try_get(0).map_err(get)?;
            let token: i64 = row.try_get(1).map_err(get)?;
            done.insert((hash, token));
        }
        Ok(items
            .iter()
            .zip(out)
            .map(|(c, pre)| {
                pre.unwrap_or_else(|| {
                    let token = i64::try_from(c.lease.token()).unwrap_or(-1);
                    if done.contains(&(c.lease.key().hash().0.to_vec(), token)) {
                        Ok(())
                    } else {
                        Err(StoreError::LeaseLost { key: c.lease.key().to_string() })
                    }
                })
            })
            .collect())
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
            .bind(self.skew())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("release", e))?;
        fenced(done.rows_affected(), &lease)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let until: Option<Option<i64>> =
            sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.extend)))
                .bind(&lease.key().hash().0[..])
                .bind(i64_of(lease.token(), "token")?)
                .bind(self.skew())
                .bind(duration_micros(by))
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| backend("extend", e))?;
        let Some(Some(until)) = until else {
            return Err(StoreError::LeaseLost { key: lease.key().to_string() });
        };
        lease.set_until(Timestamp::from_micros(until));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(self.skew())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            // Planned each time, as `complete_many` (a plan cached on a tiny table scans it all).
            .persistent(false)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("purge", e))?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        PostgresStore::check(self).await
    }
}

/// Adds `claim_many`'s rows (winners or losers) to `found`, by key hash.
fn decode_claimed(
    rows: &[PgRow],
    found: &mut HashMap<[u8; 32], (bool, Record, Timestamp)>,
) -> Result<(), StoreError> {
    for row in rows {
        let get = |e| backend("claim_many", e);
        let won: bool = row.try_get(0).map_err(get)?;
        // The record columns follow the leading `won` flag.
        let raw = decode_row_at(row, 1)?;
        let now: i64 = row.try_get(14).map_err(get)?;
        found.insert(raw.key_hash.0, (won, raw, Timestamp::from_micros(now)));
    }
    Ok(())
}

impl InspectStore for PostgresStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("get", e))?;
        Ok(self.fetch(&mut conn, key).await?.map(|(r, _)| r))
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
            .bind(self.skew())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("count", e))?;
        crate::row::counts_of(&rows)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_release)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_fail)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .bind(reason.as_bytes())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(done.rows_affected() == 1)
    }
}

impl VersionGuard for PostgresStore {
    async fn advance(&self, entity: &DedupKey, version: i64) -> Result<Advance, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("advance", e))?;
        self.advance_in(&mut conn, entity, version).await
    }
}
